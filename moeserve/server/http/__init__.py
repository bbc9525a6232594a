"""The HTTP layer of the server process (FastAPI, uvicorn), over a ServingClient (serving_client.py).

app.py assembles the app from the endpoint modules' routers: native_serving.py (/generate),
openai_serving.py (/v1/...), info.py (health and info), control.py (load, cache, aborts, expert
distribution), metrics.py (/metrics); server.py runs it (run_server). Around them: protocol.py (request
bodies), errors.py (OpenAI-shaped errors), context.py (ServerContext, what every route gets), streams.py
(one engine request as the HTTP layer runs it), responses.py (JSON or SSE answers).
"""
