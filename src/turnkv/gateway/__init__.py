"""The gateway: the ASGI app (``app``), its front ends (``routes``, ``responses``), its edge (``edge``,
``auth``, ``inflight``, ``connections``, ``body``), the turn pipeline (``turn``), errors as responses
(``error_responses``) and the long-lived services the pipeline uses (``fleet``, ``pins``,
``decode_admission``, ``release``, ``metrics``)."""
