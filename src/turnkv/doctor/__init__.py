"""``turnkv doctor``: one command that tells an operator whether P/D and pull-back pay on their hardware,
what to fix, and seeds the gateway with what it measured.

``run.diagnose`` describes the engines (``engine.diagnostics``), audits the chat template, probes the KV
transfer both ways (``probe``), and judges (``checks``: pure functions to ``findings``); ``report``
prints it, ``command`` is the command line, and ``turnkv.profile`` is the file ``turnkv serve`` loads.
"""
