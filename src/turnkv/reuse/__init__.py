"""Whether, and how much of, a stored decode KV a turn may reuse (``assess``, over the token hash chains of
``chain``), and whether reusing it pays (``cost``, ``estimator``, ``policies``). Pure decisions, no I/O."""
