"""The Prefect servers rollflow starts (prefect_server.py, running prefect_app.py) and the
Prefect settings every entry point runs with (prefect_env.py); no flow imports them."""
