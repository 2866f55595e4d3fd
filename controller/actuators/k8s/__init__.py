"""The Kubernetes actuator's parts, each testable alone against a fake API server.

``api`` (client calls, error mapping, the leader fence on writes), ``nodes`` (quarantine:
cordon, taint, Node condition, ownership, drain through the eviction API), ``events``
(core/v1 Events), ``lease`` (``coordination.k8s.io/v1`` leader election), ``placement``
(a job's rank -> pod -> node layout, learned from the ranks' own hellos, and its workload
found from owner references), ``watch`` (a list+watch node cache that survives 410 Gone).
"""
