"""An OpenAI-compatible HTTP server over `eyas.LLM`: `build_app` and `serve` in app.py, `add_cli` in cli.py."""
