"""One task's work: a prompt (or a conversation's turns) from message to kept row.

| module       | what                                                                        |
|--------------|-----------------------------------------------------------------------------|
| task         | the one Celery task, thin: checks the message's run, then hands over        |
| conversation | ``regenerate = "all"``: every assistant turn produced again, turn by turn   |
| generate     | one prompt in five steps: prepare → reserve → call → rebuild → settle       |
| retry        | after a failed attempt: retry (when), fail the prompt, or halt the fleet    |
| rebuild      | an ``Answer`` → the token-exact row, and the self-check before it is kept   |
| engine_ids   | rows from an engine's own ids, the text rebuild as their cross-check        |
| target       | the target's tokenizer: loading, its turn format, the start-up check        |

Nothing here talks HTTP (``workers/upstreams/``) or knows how the worker process is run
(``workers/fleet/``).
"""
