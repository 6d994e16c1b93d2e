"""One task's work: a prompt (or a conversation's turns) from message to kept row.

| module       | what                                                                        |
|--------------|-----------------------------------------------------------------------------|
| task         | the one Celery task, thin: checks the message's run, then hands over        |
| conversation | ``regenerate = "all"``: every assistant turn produced again, turn by turn   |
| generate     | one prompt in five steps: prepare → reserve → call → rebuild → settle       |
| retry        | after a failed attempt: retry (when), fail the prompt, or halt the fleet    |
| engine_ids   | rows from an engine's own ids, the text rebuild as their cross-check        |

The rebuild and the target's tokenizer are in ``common/rebuild.py`` and ``common/target.py``:
``specfleet validate`` re-checks rows with the same code. Nothing here talks HTTP
(``workers/upstreams/``) or knows how the worker process is run (``workers/fleet/``).
"""
