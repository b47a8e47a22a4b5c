"""``quasar-deploy serve``: an OpenAI-compatible HTTP server over one engine, many requests at once.

``protocol`` parses and checks requests (pure Python), ``scheduler`` runs every
admitted request's generation on its own sequence, one verify step each in turn,
``metrics`` is the Prometheus side, ``app`` the FastAPI routes, ``server`` runs
uvicorn with a draining shutdown, ``vllm`` builds the command line for serving
with vLLM / vLLM-Ascend instead.
"""
