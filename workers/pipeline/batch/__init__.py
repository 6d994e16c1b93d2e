"""Batch mode: a dataset's prompts through OpenRouter's Batch API (about half the price), one of the
task's modes (``workers/pipeline/task.py``'s ``MODES``), a peer of single and conversation mode.

| module | what lives there |
| --- | --- |
| ``submit.py`` | the task's side: prepare, reserve at the batch price, gather, record the intent, POST |
| ``records.py`` | the batch's durable record in Redis: the intent before the POST, the batch id after |
| ``poll.py`` | any worker polls open batches (a lease each), recovers a lost POST, settles terminal ones |
| ``results.py`` | one result through ``workers/pipeline/job.py``'s prepare, rebuild (self-checked), settle |

The upstream's wire format is ``workers/upstreams/openrouter_batch.py``; the read side of the records
(progress, status, exporter) is ``common/batches.py``.
"""
