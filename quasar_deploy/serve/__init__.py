"""``quasar-deploy serve``: an OpenAI-compatible HTTP server over one engine, many requests at once.

``protocol`` checks requests, ``scheduler`` steps their sequences, ``app`` the routes, ``server`` uvicorn, ``vllm`` vLLM."""
