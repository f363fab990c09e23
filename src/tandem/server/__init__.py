"""The OpenAI-compatible server: protocol (pydantic), app (FastAPI), the engine thread and metrics.

Imported by `tandem.launch_server` (and so by the `tandem` command), never by `import tandem`,
which stays light.
"""
