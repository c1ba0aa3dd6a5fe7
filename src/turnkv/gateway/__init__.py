"""The gateway: the ASGI app (``app``), its front ends (``routes``, ``responses``), its edge (``edge``,
``auth``, ``admission``, ``connections``), the turn pipeline (``turn``) and the long-lived services the
pipeline uses (``fleet``, ``pins``, ``release``, ``metrics``)."""
