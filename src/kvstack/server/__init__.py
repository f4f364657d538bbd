"""HTTP server: OpenAI- and Anthropic-compatible APIs over the async engine.

`kvstack.server.app.create_app` builds the app; `kvstack serve` runs it. Importing this package
does not import FastAPI, so the CLI stays quick for other commands.
"""
