"""Sandboxes for the commands the live dispatcher runs: per-trajectory workspaces,
kernel-enforced isolation (namespaces made by bubblewrap, entered by a small root
server; or gVisor containers) and per-command cgroups (cpuset, memory, pids; v2, v1 or
both).

Modules: :mod:`.config` (the settings), :mod:`.manager` (the dispatcher's sandboxes;
:mod:`.handles`: a sandbox and a started command; :mod:`.slots`: the commands' slots),
:mod:`.server` and :mod:`.connection` (the process that starts commands inside them,
and the dispatcher's end of it; the server's parts: :mod:`.server_open`,
:mod:`.server_network`, :mod:`.server_records`, :mod:`.server_gvisor`), :mod:`.protocol`
(their messages), :mod:`.bwrap` (the namespaces' command line), :mod:`.gvisor` (gVisor's
bundles; containers started ahead: :mod:`.warm`), :mod:`.cgroups` (slots; which
controllers where: :mod:`.cgroup_discovery`; a cgroup's files: :mod:`.cgroup_files`),
:mod:`.workspace` (templates), :mod:`.uids`, :mod:`.rundir` (what a dispatcher made, for
recovery) and :mod:`.syscalls`. Importing this package loads none of them (the server
imports only what it needs).

This package stands below :mod:`metasched.runtime.process`: it never imports it. A
command the sandbox server starts is :mod:`metasched.runtime.process.sandboxed`'s, and
opening a node's sandboxes and starting a command in them is
:mod:`metasched.runtime.launch`'s.
"""
