"""The live dispatcher: runs real actions on local hardware under the same scheduling
core (state, encoder, masks, ``Scheduler``) as the simulator."""
