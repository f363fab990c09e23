"""The OpenAI-compatible server: protocol (pydantic), app (FastAPI), the engine thread and metrics.

Imported only by `tandem serve` / `python -m tandem.launch_server`, so `import tandem` stays light.
"""
