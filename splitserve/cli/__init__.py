"""The top floor: the `splitserve` command, one module a command (app.py mounts them), and the
launcher `splitserve up` starts a cluster with. Nothing below splitserve/cli/ imports from here.

Importing this package costs nothing: `main` loads the app when it runs (the console script,
splitserve/entry.py, turns a missing extra into one line naming it).
"""


def main() -> None:
    from splitserve.cli.app import main as run

    run()
