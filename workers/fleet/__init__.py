"""The worker as one process of a fleet: Redis, queues, flow control, recovery, stopping.

| module       | what                                                                         |
|--------------|------------------------------------------------------------------------------|
| context      | per-process state: settings, Redis, the upstream, run views, tokenizers      |
| queues       | the bootstep that follows the active dataset queues                          |
| consumer     | Celery's consumer, binding nothing while Redis refuses writes                |
| poison       | messages a worker refuses to run, and the dead-letter list                   |
| gate         | the process's door to the fleet-wide throttle                                |
| send_room    | how many prompts to take: what can be sent within the next second            |
| answer_room  | how many answer bytes become rows at once                                    |
| group_commit | many greenlets' budget calls in one pipeline behind one AOF fence            |
| spool        | a paid answer kept on local disk while Redis is away, replayed after         |
| recovery     | bootsteps that bring back unacked messages and spooled outcomes              |
| writes       | Redis refusing writes as a state of the worker                               |
| server       | which Redis the worker serves; never another run's without saying so         |
| stop         | SIGTERM ends the worker within ``STOP_BOUND_S``                              |
| events       | task events in batches, for Flower                                           |
| heap         | the long-lived heap frozen out of the cyclic garbage collector               |
"""
