"""The live view of the cache (`GET /ui`): the block pool, the prefix tree, charts over the
last minutes and a playground that shows where each prompt token's K/V came from.

The package sits between the engine and the server: it reads the engine's public values
(`KVSnapshot`, `EngineStats`, `RequestOutput.provenance`) and builds a FastAPI router from a
`UiHost` the server hands it (authentication, how to start a request, tenant labels), so it
never imports the server. Static files ship in `static/` as package data; no build step.
"""
