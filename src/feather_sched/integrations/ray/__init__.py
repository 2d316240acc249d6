"""Ray Serve: ``router`` (``FeatherRequestRouter``, the engine-agnostic ``FeatherRouter``
behind Ray's request-router API, fed by vLLM's KV events), ``app`` (the vLLM replicas and
the OpenAI ingress of ``feather serve --replicas``) and ``metrics`` (each replica's
``feather:`` series relayed with a ``replica`` label)."""
