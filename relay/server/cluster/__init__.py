"""Several server processes sharing one worker pool through Redis (SPEC §11).

``placement`` (where a request goes: reservations and the shared queue) with its
``convergence`` (the control loop that brings every process back to the truth after any
failure) and ``preempt`` (priority classes across processes), ``state`` and ``scripts``
(that shared state in Redis, as atomic Lua scripts), ``proxy`` and ``peerhttp`` (a request
served by another process's worker, over HTTP between the processes), ``control``
(membership lists and control messages through the channel layer), ``limits`` (the
per-key limit counters in Redis) with ``limitshare`` (each process's share of them while
Redis cannot answer), ``leanredis`` (the pipelined client the per-request scripts use),
``streamstore``, ``streamentry``, ``streamwriter`` and ``followers`` (resumable
responses' logs in Redis: kept, described, written, read and followed) with
``streamrecovery`` (what they do while Redis fails or fails over), and ``redisconf`` and
``redissource`` (where Redis is, one URL or a master found through Sentinel, and every
connection to it built from that: SPEC §20).
"""
