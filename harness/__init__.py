"""The test and bench harness: what tests/ and bench/ both start and break, never product code.

``fleet``: a real fleet as subprocesses (simulator, ``celery worker`` processes, the producer) on
a Redis the caller gives; ``chaos``: a private Valkey with AOF that can be SIGKILLed and started
again, poison messages, the output folder as a reader sees it; ``conversations``: multi-turn
datasets and the checks their rows must pass. tests/fleet.py, tests/chaos.py and
tests/conversation_data.py re-export them under the tests' old import paths.
"""
