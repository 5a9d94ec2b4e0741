"""An agent's sandbox through the unmodified ``e2b`` SDK, served by metasched-serve.

Start the service, point the SDK at it, run this:

    .venv/bin/metasched-serve scheduler=elastic_greedy            # terminal 1
    export E2B_API_URL=http://127.0.0.1:8080/e2b                  # terminal 2
    export E2B_SANDBOX_URL=http://127.0.0.1:8080/e2b
    export E2B_API_KEY=unused       # with a token set on the service: that token
    .venv/bin/python examples/e2b_sandbox.py

It creates a sandbox (a trajectory of the dispatcher), runs a few turns of an agent
loop (a program written, run, its output file read back), starts a background process
and kills it, lists the sandbox, and kills it (its workspace goes with it). Every
command and file call is one action, scheduled and journaled by the dispatcher.
"""

from __future__ import annotations

import os
import sys

from e2b import Sandbox


def main() -> None:
    for name in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
        if not os.environ.get(name):
            sys.exit(f"{name}: not set (see this script's docstring)")
    sandbox = Sandbox.create(timeout=300, metadata={"example": "e2b_sandbox"},
                             envs={"GREETING": "hello"})
    print(f"sandbox {sandbox.sandbox_id} created")
    try:
        for turn in range(3):
            sandbox.files.write(f"turn_{turn}.py", (
                "import os\n"
                f"open('answer_{turn}.txt', 'w').write(os.environ['GREETING'] + ' {turn}')\n"
                f"print('turn {turn} done')\n"))
            ran = sandbox.commands.run(f"python3 turn_{turn}.py")
            answer = sandbox.files.read(f"answer_{turn}.txt")
            print(f"turn {turn}: exit {ran.exit_code}, stdout {ran.stdout.strip()!r}, "
                  f"file {answer!r}")
        server = sandbox.commands.run("sleep 600", background=True, timeout=0)
        print(f"background process {server.pid}: running "
              f"{[p.pid for p in sandbox.commands.list()]}; killed: {server.kill()}")
        print("files:", sorted(e.name for e in sandbox.files.list(".")))
        print("sandboxes:", [s.sandbox_id for s in Sandbox.list().next_items()])
    finally:
        sandbox.kill()
    print(f"sandbox {sandbox.sandbox_id} killed")


if __name__ == "__main__":
    main()
