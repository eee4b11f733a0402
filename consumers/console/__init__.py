"""The operator console: a web page of the fleet now, the approver's decisions, the operators'
actions (approve, hold, release) and the audit's history, served by ``scheduled-events
console``.

::

    scheduled-events console-user users.txt alice --role operator     # asks for a password
    scheduled-events console --broker "$BROKER" --db "$DB" --signing-key approver.key \\
        --users users.txt --listen 127.0.0.1:8600

The web stack (Starlette, uvicorn) is the ``[console]`` extra, imported only when the console
runs. Modules: ``_service`` (the engine: fleet, decisions, holds, actions), ``_live`` (rows and
what changed), ``_feed`` (batches to the pages), ``_app`` (routes, sign-in, CSRF), ``_auth``,
``_sessions``, ``_users`` (who may do what), ``_server`` (uvicorn), ``_cli`` (the commands),
``static/`` (one HTML page, one script, one style sheet, and the sign-in page).
"""

from ._cli import add_console_commands

__all__ = ["add_console_commands"]
