"""The one error tree of specfleet.

Every failure the product reports is a ``SpecfleetError``. Foreign exceptions (requests, redis,
tokenizers) are translated at the boundary that meets them, so callers decide on a class, never on
a library's exception or a message string. The tree (httpx's ``_exceptions.py`` is the model)::

    SpecfleetError                     any failure ending a command, unless its class says otherwise: exit 2
    ├── ConfigError                    a run file or environment variable is wrong: exit 2
    │   ├── PlanRefused                the plan says the run must not start
    │   ├── UnknownModel               the models endpoint does not list the run file's model
    │   └── RedisTooOld                REDIS_URL names a server older than the supported minimum
    ├── DatasetRowError                one dataset row is unusable (file:line); the rest runs
    ├── DatasetFieldError              a row's field is not in a form specfleet reads (also a ValueError)
    ├── DatasetPathError               a dataset's path names nothing readable (also a ValueError)
    ├── ModelsUnavailable              the models endpoint could not be read
    ├── PriceUnusable                  a listed price is not a number, or negative (also a ValueError)
    ├── UpstreamError                  no usable answer (workers/pipeline/retry.py decides on the class)
    │   ├── RetryableUpstreamError     try again: 408, 429, 5xx, resets, bad JSON
    │   │   ├── UpstreamTimeoutError   the attempt's timeout_s passed
    │   │   └── InFlightBudgetError    402 in_flight_budget_exhausted: the fleet slows, no attempt spent
    │   ├── FatalUpstreamError         fail this prompt: 400, 403, filtered
    │   │   ├── AnswerTooLargeError    over SPECFLEET_MAX_ANSWER_BYTES
    │   │   └── WeightExceedsBudgetError  402 weight_exceeds_budget: max_tokens alone is over the balance
    │   ├── AccountRefusedError        halt the fleet: 401, any other 402 (out of credits, key limit)
    │   └── MisconfiguredError         halt once it repeats: 404, model not found
    ├── BatchSubmitError               a Batch API submission did not (surely) create a batch
    │   └── BatchRefused               4xx: surely not created (no :batch variant, over a limit)
    ├── LostPoll                       (inside a worker's batch poll) its poll lease lapsed: another settles it
    ├── TokenizerError                 the target tokenizer cannot load or fails its round trip
    ├── TokenMismatch                  a rebuilt row failed its self-check
    ├── PromptFailed                   (inside a worker's task) the prompt fails with a reason
    ├── PromptEnded                    (inside a worker's task) the lease says: stop, no outcome
    ├── PoisonMessage                  (inside a worker's read) a queue message is not one of ours
    ├── RedisRefusesWrites             Redis answers, refuses writes past the retry window: exit 6
    ├── ProducerFenced                 another producer holds the lock: exit 5
    ├── Interrupted                    SIGTERM/SIGINT: the run stopped, resumable: exit 130
    ├── Halted                         the fleet stopped admitting (account, URL, model): exit 3
    ├── IllegalTransition              a dataset run asked for a phase move its table forbids (a bug)
    ├── ScriptReplyError               a Lua script answered a word its Python face lacks (also a ValueError)
    ├── PatchDrift                     a library changed code specfleet patches: the worker refuses, exit 8
    └── OutputError                    the output folder refused a write

    redis.exceptions.ConnectionError
    └── RedisOutage                    Redis unreachable past the retry window: exit 4

``RedisOutage`` alone is not a ``SpecfleetError``: it is raised from inside redis-py (the retry of
``common/redis_client.py``), so every clause that catches an unreachable Redis (``UNREACHABLE``,
kombu's and Celery's reconnects, ``except redis.ConnectionError``) must keep catching it, and the
clauses that catch ``SpecfleetError`` (a worker refusing a run it cannot prepare, the CLI's exit 2)
must not take an outage for a bad run file.

Exit codes: each class's ``exit_code`` (the "exit N" above; tests/test_errors.py holds the two
equal), the one table the CLI (``producer/cli.py``), the run (``producer/execute.py``) and the
worker (``workers/runtime``, ``workers/fleet/consumer.py``) exit by. The producer's one code that is
no error, 7 (stopped while Redis was unreachable), is ``producer/execute.EXIT_STOPPED_REDIS_AWAY``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from redis.exceptions import ConnectionError as RedisConnectionError

if TYPE_CHECKING:
    from common.contract import Usage
    from common.outcomes import Outcome


class SpecfleetError(Exception):
    """Base of every error specfleet raises on purpose."""

    #: The process's exit code when this error ends a command (a class that means another says so).
    exit_code: ClassVar[int] = 2


# --- input the user gave us -------------------------------------------------------------------


class ConfigError(SpecfleetError):
    """A run file or environment variable is wrong; the message names the file/variable and field."""


class PlanRefused(ConfigError):
    """The run must not start (``producer/plan.py``): one line per problem."""


class UnknownModel(ConfigError):
    """The models endpoint answered, and the run file's model is not in its list."""


class RedisTooOld(ConfigError):
    """``REDIS_URL`` names a server older than specfleet supports (``common/redis_server.py``):
    the producer and every worker refuse it at start, before a command it lacks fails mid-run."""

    def __init__(self, server: str, minimum: str) -> None:
        super().__init__(f"the Redis at REDIS_URL is {server}; specfleet needs {minimum}")
        self.server = server
        self.minimum = minimum


class DatasetPathError(SpecfleetError, ValueError):
    """A dataset's ``path`` names nothing the reader can read (the message says why)."""


class DatasetFieldError(SpecfleetError, ValueError):
    """A row's field is not in a form the reader takes; the message names the field
    (``messages[2].role``), and the reader turns it into a ``DatasetRowError`` naming file:line."""


class DatasetRowError(SpecfleetError):
    """One dataset row cannot be used. ``where`` is ``file:line``; the rest of the file still runs."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


# --- the upstream API ---------------------------------------------------------------------------


class UpstreamError(SpecfleetError):
    """The upstream (OpenRouter, or any ``workers.upstreams.upstream.Upstream``) gave no usable answer.

    The class says what to do about it (``workers/pipeline/retry.py`` decides on the class alone):
    ``RetryableUpstreamError`` try again, ``FatalUpstreamError`` fail this prompt,
    ``AccountRefusedError`` halt the fleet at once, ``MisconfiguredError`` halt the fleet once it
    repeats across prompts. ``status`` is the HTTP status (200 for an error object inside a 200
    body, 0 when no response arrived), ``code`` the error object's code inside a 200 body (None
    otherwise), ``reason`` a short stable word for reports (``http_429``, ``timeout``, ``bad_json`` …)
    and ``detail`` what the server said, without the reason. ``usage``: what this failed attempt
    was billed, when the reply said so (an answer too large to keep); None when unknown.
    """

    retryable = False

    def __init__(
        self, reason: str, detail: str, *, status: int = 0, retry_after_s: float | None = None,
        code: int | None = None, usage: Usage | None = None,
    ) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.status = status
        self.retry_after_s = retry_after_s
        self.code = code
        self.usage = usage


class RetryableUpstreamError(UpstreamError):
    """Worth another attempt: 408, 429, 5xx, timeouts, resets, malformed JSON, 200-with-error,
    and a 402 of the in-flight budget (``InFlightBudgetError``)."""

    retryable = True


class UpstreamTimeoutError(RetryableUpstreamError):
    """The attempt's ``timeout_s`` passed before the whole answer was in (connect, headers and the
    full body, however slowly its bytes came). The connection is closed, never reused half-read;
    the provider may still generate and bill a non-streamed request."""


class InFlightBudgetError(RetryableUpstreamError):
    """402 ``in_flight_budget_exhausted`` (``limit_source = openrouter_in_flight_budget``, with
    ``Retry-After``): the account's balance cannot cover the worst cases of every request the fleet
    has in flight. A signal for the fleet's concurrency, like a congestion 429: it cuts the fleet's
    in-flight limit and pauses every worker for its ``Retry-After`` (``workers/fleet/gate.py``), and
    the refused request is asked again without spending one of the prompt's attempts (nothing was
    generated or billed)."""


class FatalUpstreamError(UpstreamError):
    """Another attempt at this prompt cannot help (400, 403, a filtered answer): the prompt fails."""


class AnswerTooLargeError(FatalUpstreamError):
    """The answer's body is over ``SPECFLEET_MAX_ANSWER_BYTES``: read to its end without being kept
    (``usage`` is what its tail says was billed), the prompt fails ``answer_too_large``. Another
    attempt would pay for another answer of about the same size."""


class WeightExceedsBudgetError(FatalUpstreamError):
    """402 ``weight_exceeds_budget``: this one request's estimate (its prompt plus ``max_tokens`` at
    the model's price) exceeds the account's whole balance. Retrying never helps: the prompt fails
    at once, its detail naming ``max_tokens`` (lower it, or add credits)."""


class AccountRefusedError(UpstreamError):
    """The account, not the prompt, is at fault (401 bad key, 402 out of credits or over the key's
    limit): every prompt would fail alike, so the fleet halts instead."""


class MisconfiguredError(UpstreamError):
    """The fleet points at the wrong place: a 404, or "model not found / No endpoints found".

    ``target`` names the URL and the model asked for, so the halt line says what to fix. One such
    answer may be a prompt's own (no provider serves its tools): the fleet halts only when it
    repeats across prompts (``workers/pipeline/retry.py``). ``fix``: what to do when it is not a
    URL or model name but the server itself (an engine without ids): the halt line ends with it."""

    def __init__(self, reason: str, detail: str, *, target: str, status: int = 0, fix: str | None = None) -> None:
        super().__init__(reason, detail, status=status)
        self.target = target
        self.fix = fix
        if fix is not None:
            self.args = (f"{reason}: {detail}; {fix}",)


class ModelsUnavailable(SpecfleetError):
    """The models endpoint could not be read: prices and context length are unknown."""


# --- the target tokenizer -----------------------------------------------------------------------


class PriceUnusable(SpecfleetError, ValueError):
    """A price of the models list is not a number, or negative (OpenRouter lists "-1" for router
    models whose price is not fixed): ``producer/models.py`` takes the model's price as unknown."""


class BatchSubmitError(SpecfleetError):
    """``POST /api/v1/batches`` had no usable answer (a timeout, a reset, a 5xx): the batch may exist
    and bill. Never posted again before ``GET /api/v1/batches?created_after=…`` says it does not."""


class BatchRefused(BatchSubmitError):
    """``POST /api/v1/batches`` answered 4xx: no batch was created (nothing billed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class LostPoll(SpecfleetError):
    """A worker's poll lease of a batch lapsed mid-settle: it stops and the new poller goes on (the
    budget's settle counts a result once per lease, whoever repeats it)."""


class TokenizerError(SpecfleetError):
    """The target tokenizer cannot be loaded, or fails the start-up round-trip check.

    Raised before any request is sent, so a broken tokenizer never costs money.
    """


class TokenMismatch(SpecfleetError):
    """A rebuilt row failed its self-check; it is written to ``failed.jsonl``, never as a good row.

    ``position`` is the first differing token index within the completion (or -1 when the check
    that failed is not positional), ``check`` names which self-check failed.
    """

    def __init__(self, check: str, position: int, detail: str) -> None:
        super().__init__(f"token_mismatch ({check}) at completion position {position}: {detail}")
        self.check = check
        self.position = position
        self.detail = detail


# --- inside a worker's task (workers/pipeline/job.py): how a prompt leaves its pipeline early ------


class PromptFailed(SpecfleetError):
    """The prompt fails with ``reason`` (``prompt_too_long``, a retry decision's reason …); caught by
    ``generate()``, which records the failure. Never leaves the task."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail


class PromptEnded(SpecfleetError):
    """The lease renewal found the prompt must end without another attempt (``outcome``: done,
    skipped:stopped, halted, lost); caught by the call step. Never leaves the task."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class PoisonMessage(SpecfleetError):
    """A message read from a queue is not a task of ours (``reason``: a stable word of
    workers/fleet/poison.py's list); caught by ``poison.admit``, which dead-letters it. Never leaves the read."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


# --- the store ----------------------------------------------------------------------------------


class RedisOutage(RedisConnectionError):
    """Redis stayed unreachable longer than the retry window (``common/redis_client.py``)."""

    def __init__(self, window_s: float, cause: BaseException) -> None:
        super().__init__(f"Redis unreachable for {window_s:.0f} s ({cause})")
        self.window_s = window_s

    exit_code: ClassVar[int] = 4


class RedisRefusesWrites(SpecfleetError):
    """Redis answers but refuses writes (maxmemory reached with noeviction, or a read-only replica)
    for longer than the retry window. ``what`` is the one line that says which and what to do."""

    exit_code: ClassVar[int] = 6

    def __init__(self, what: str, window_s: float) -> None:
        super().__init__(f"{what} (refused for {window_s:.0f} s)")
        self.what = what
        self.window_s = window_s


class ProducerFenced(SpecfleetError):
    """Another producer took the producer lock (a newer generation) while this one was paused or
    cut off: this one must not write again, in Redis or in the output folder."""

    exit_code: ClassVar[int] = 5


# --- how a run ends short of done --------------------------------------------------------------


class Interrupted(SpecfleetError):
    """SIGTERM/SIGINT: the run stopped where it was; running it again resumes."""

    exit_code: ClassVar[int] = 130


class Halted(SpecfleetError):
    """A worker found the OpenRouter account refused (bad key, no credits) or the URL/model wrong:
    the fleet stopped admitting; nothing was marked failed, and running again after the fix resumes."""

    exit_code: ClassVar[int] = 3


# --- the output folder --------------------------------------------------------------------------


class IllegalTransition(SpecfleetError):
    """A dataset run was asked to move between two phases ``producer/dataset_run.TRANSITIONS`` does
    not join: a bug in the runner, refused before it could act on a state it never planned for."""


class ScriptReplyError(SpecfleetError, ValueError):
    """budget.lua or throttle.lua answered a word ``common/outcomes.py`` does not list for the
    operation: the script and the code that reads it are of two versions."""


class PatchDrift(SpecfleetError):
    """An installed library's source differs where specfleet patches it (``common/runtime.py``):
    the process refuses to run on code nobody verified. The message is the whole one-line reason."""

    #: Not 7: that is the producer's stop while Redis was unreachable (producer/execute.py).
    exit_code: ClassVar[int] = 8

    def __init__(self, message: str, *, patch: str, dist: str) -> None:
        super().__init__(message)
        self.patch = patch
        self.dist = dist


class OutputError(SpecfleetError):
    """The output folder refused a write (full, read-only, over a file size limit).

    Nothing is lost: rows not yet written stay in Redis, and running the same command again
    (once the folder is writable) writes them exactly once.
    """


def exit_classes() -> list[type[SpecfleetError] | type[RedisOutage]]:
    """The classes that set their own ``exit_code``, in the tree's order: the table of exit codes."""
    tree: list[type[SpecfleetError] | type[RedisOutage]] = [SpecfleetError, *_subclasses(SpecfleetError), RedisOutage]
    return [cls for cls in tree if "exit_code" in vars(cls)]


def _subclasses(cls: type[SpecfleetError]) -> list[type[SpecfleetError]]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]
