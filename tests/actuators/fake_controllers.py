"""The fake cluster's Job, JobSet and PyTorchJob (training operator) controllers and its
scheduler (a mixin of :class:`tests.actuators.fake_cluster.FakeCluster`), enough for gang
restarts: :meth:`WorkloadControllers.reconcile_pytorchjob` acts as the Kubeflow Training
Operator (kubeflow.org/v1) would: it recreates a PyTorchJob's deleted pods, and its Failed
pods that ``restartPolicy: ExitCode`` says to retry, from the current spec, with the
environment the operator injects for torchrun; a deleted or
evicted pod fails its Job when ``backoffLimit`` is 0 (an eviction not, when the Job's
podFailurePolicy ignores ``DisruptionTarget``); :meth:`WorkloadControllers.reconcile_jobset`
creates the child Jobs and their pods on schedulable, untainted nodes and, when a child Job
failed, recreates them all (``status.restarts`` + 1) until ``failurePolicy.maxRestarts``,
then fails the JobSet.
"""

from __future__ import annotations

import copy
from typing import Any

from tests.actuators.fake_kube import Key


def _refs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return list(obj["metadata"].get("ownerReferences") or [])


class WorkloadControllers:
    """Works on the server's store through ``objects``, ``lock``, ``put``, ``_store`` and
    ``_delete`` (those of :class:`~tests.actuators.fake_cluster.FakeCluster`)."""

    objects: dict[Key, dict[str, Any]]
    lock: Any
    put: Any
    _store: Any
    _delete: Any

    # -- the Job and JobSet controllers and a scheduler, enough for gang restarts --------

    def _pod_failed(self, pod: dict[str, Any], *, evicted: bool) -> None:
        """The Job controller: a pod that ended early counts against ``backoffLimit``
        (an eviction is ignored when the Job's podFailurePolicy ignores DisruptionTarget)."""
        owner = next((r for r in _refs(pod) if r.get("kind") == "Job"), None)
        key = ("batch", "jobs", pod["metadata"].get("namespace", ""), (owner or {}).get("name"))
        job = self.objects.get(key)  # type: ignore[arg-type]
        if job is None:
            return
        spec = job.get("spec") or {}
        rules = (spec.get("podFailurePolicy") or {}).get("rules") or []
        ignored = any(
            r.get("action") == "Ignore"
            and any(c.get("type") == "DisruptionTarget" for c in r.get("onPodConditions") or [])
            for r in rules
        )
        if (evicted and ignored) or int(spec.get("backoffLimit", 6)) > 0:
            return
        new = copy.deepcopy(job)
        status = new.setdefault("status", {})
        status["failed"] = int(status.get("failed") or 0) + 1
        status["conditions"] = [
            {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}
        ]
        self._store(key, new)  # type: ignore[arg-type]

    def schedule(self, pod: dict[str, Any]) -> str:
        """A scheduler: the schedulable, untainted node with the fewest pods."""
        load: dict[str, int] = {}
        for (g, pl, _, _), o in self.objects.items():
            if (g, pl) == ("", "pods"):
                n = o.get("spec", {}).get("nodeName", "")
                load[n] = load.get(n, 0) + 1
        tolerated = {t.get("key") for t in pod["spec"].get("tolerations") or []}
        eligible = [
            n["metadata"]["name"]
            for (g, pl, _, _), n in sorted(self.objects.items())
            if (g, pl) == ("", "nodes")
            and not n.get("spec", {}).get("unschedulable")
            and not any(
                t.get("effect") in ("NoSchedule", "NoExecute") and t.get("key") not in tolerated
                for t in n.get("spec", {}).get("taints") or []
            )
        ]
        if not eligible:
            return ""
        return min(eligible, key=lambda name: (load.get(name, 0), name))

    def reconcile_jobset(self, ns: str, name: str) -> str:
        """One reconcile of JobSet ``name``, as its controller would: create missing child
        Jobs and their pods (scheduled), and when a child Job failed restart the whole gang
        (``status.restarts`` + 1) or, past ``failurePolicy.maxRestarts``, fail the JobSet.
        Returns ``created``, ``restarted``, ``failed`` or ``nothing``."""
        with self.lock:
            key = ("jobset.x-k8s.io", "jobsets", ns, name)
            js = self.objects[key]
            uid = js["metadata"]["uid"]
            children = [
                k
                for k, j in self.objects.items()
                if k[:3] == ("batch", "jobs", ns) and any(r.get("uid") == uid for r in _refs(j))
            ]
            failed = any(
                c.get("type") == "Failed" and c.get("status") == "True"
                for k in children
                for c in self.objects[k].get("status", {}).get("conditions") or []
            )
            if js.get("status", {}).get("terminalState") or js["spec"].get("suspend"):
                return "nothing"
            new = copy.deepcopy(js)
            status = new.setdefault("status", {})
            if failed:
                attempt = int(status.get("restarts") or 0)
                max_restarts = int((js["spec"].get("failurePolicy") or {}).get("maxRestarts", 0))
                if attempt >= max_restarts:
                    status["terminalState"] = "Failed"
                    status["conditions"] = [
                        {"type": "Failed", "status": "True", "reason": "FailedJobs"}
                    ]
                    self._store(key, new)
                    return "failed"
                for child in children:
                    self._delete(child, {}, None)
                status["restarts"] = attempt + 1
                self._store(key, new)
                self._create_children(new)
                return "restarted"
            if children:
                return "nothing"
            self._create_children(new)
            return "created"

    def _create_children(self, js: dict[str, Any]) -> None:
        meta = js["metadata"]
        ns, name = meta["namespace"], meta["name"]
        ref = {
            "apiVersion": js["apiVersion"],
            "kind": "JobSet",
            "name": name,
            "uid": meta["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        restarts = str(js.get("status", {}).get("restarts") or 0)
        for rj in js["spec"].get("replicatedJobs") or []:
            for index in range(int(rj.get("replicas", 1))):
                labels = {
                    "jobset.sigs.k8s.io/jobset-name": name,
                    "jobset.sigs.k8s.io/replicatedjob-name": rj["name"],
                    "jobset.sigs.k8s.io/job-index": str(index),
                    "jobset.sigs.k8s.io/restart-attempt": restarts,
                }
                job_name = f"{name}-{rj['name']}-{index}"
                spec = copy.deepcopy(rj["template"]["spec"])
                job = self.put(
                    "batch",
                    "jobs",
                    {
                        "metadata": {
                            "name": job_name,
                            "namespace": ns,
                            "labels": labels,
                            "ownerReferences": [ref],
                        },
                        "spec": spec,
                    },
                )
                job_ref = {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": job_name,
                    "uid": job["metadata"]["uid"],
                    "controller": True,
                }
                template = spec.get("template") or {}
                for i in range(int(spec.get("parallelism") or 1)):
                    pod_meta = copy.deepcopy(template.get("metadata") or {})
                    pod_meta["labels"] = {
                        **(pod_meta.get("labels") or {}),
                        **labels,
                        "batch.kubernetes.io/job-completion-index": str(i),
                    }
                    pod_meta.update(
                        name=f"{job_name}-{i}-r{restarts}", namespace=ns, ownerReferences=[job_ref]
                    )
                    pod = {"metadata": pod_meta, "spec": copy.deepcopy(template.get("spec") or {})}
                    pod["spec"]["nodeName"] = self.schedule(pod)
                    pod["status"] = {"phase": "Running" if pod["spec"]["nodeName"] else "Pending"}
                    self.put("", "pods", pod)

    def reconcile_pytorchjob(self, ns: str, name: str) -> list[str]:
        """One reconcile of the Training Operator: delete the Failed pods of replicas whose
        ``restartPolicy: ExitCode`` retries their exit code (128 and above: a signal, as the
        operator counts it), create every replica's missing pod (``<job>-<type>-<index>``,
        scheduled) from the current spec, delete pods past the replica counts; nothing while
        ``runPolicy.suspend``. ``OnFailure``/``Always`` restart the container in place,
        which is the kubelet's part (the pod's ``restartPolicy``, set from the replica's).
        Returns the pods created."""
        with self.lock:
            pj = self.objects[("kubeflow.org", "pytorchjobs", ns, name)]
            if (pj["spec"].get("runPolicy") or {}).get("suspend"):
                return []
            ref = {
                "apiVersion": pj["apiVersion"],
                "kind": "PyTorchJob",
                "name": name,
                "uid": pj["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
            ours = {
                k[3]: p
                for k, p in self.objects.items()
                if k[:3] == ("", "pods", ns) and any(r.get("uid") == ref["uid"] for r in _refs(p))
            }
            specs = pj["spec"]["pytorchReplicaSpecs"]
            for pod_name, pod in sorted(ours.items()):
                rtype = (pod["metadata"].get("labels") or {}).get(
                    "training.kubeflow.org/replica-type", ""
                )
                policy = next(
                    (s.get("restartPolicy") for t, s in specs.items() if t.lower() == rtype), None
                )
                if policy == "ExitCode" and _retryable_failure(pod):
                    self._delete(("", "pods", ns, pod_name), {}, None)
                    del ours[pod_name]
            wanted: set[str] = set()
            created: list[str] = []
            for rtype, rspec in sorted(specs.items()):
                for index in range(int(rspec.get("replicas", 1))):
                    pod_name = f"{name}-{rtype.lower()}-{index}"
                    wanted.add(pod_name)
                    if pod_name in ours:
                        continue
                    pod = _operator_pod(pj, rtype, index, ref)
                    pod["spec"]["nodeName"] = self.schedule(pod)
                    pod["status"] = {"phase": "Running" if pod["spec"]["nodeName"] else "Pending"}
                    self.put("", "pods", pod)
                    created.append(pod_name)
            for extra in sorted(set(ours) - wanted):
                self._delete(("", "pods", ns, extra), {}, None)
            return created


def _retryable_failure(pod: dict[str, Any]) -> bool:
    """A Failed pod whose container ended with an exit code ``ExitCode`` retries (>= 128)."""
    if (pod.get("status") or {}).get("phase") != "Failed":
        return False
    codes = [
        ((s.get("state") or {}).get("terminated") or {}).get("exitCode", 0)
        for s in pod["status"].get("containerStatuses") or []
    ]
    return any(int(code) >= 128 for code in codes)


#: The operator's default rendezvous port (a container port named ``pytorchjob-port``
#: overrides it).
PYTORCHJOB_PORT = 23456


def _operator_pod(
    pj: dict[str, Any], rtype: str, index: int, ref: dict[str, Any]
) -> dict[str, Any]:
    """Pod ``index`` of replica type ``rtype`` as the Training Operator makes it: its
    labels, the pod ``restartPolicy`` from the replica's (``ExitCode``: ``Never``, the
    operator decides), and in every container the variables the operator injects: with a
    Master, ``MASTER_ADDR`` (the master's Service) / ``MASTER_PORT``, ``WORLD_SIZE``,
    ``RANK`` (the pod's node rank: workers count from 1) and their ``PET_*`` twins that
    torchrun reads for ``--master-addr``/``--master-port``/``--node-rank``/
    ``--nproc-per-node``; ``PET_NNODES`` (the replicas) without an ``elasticPolicy``."""
    name, ns = pj["metadata"]["name"], pj["metadata"]["namespace"]
    specs = pj["spec"]["pytorchReplicaSpecs"]
    rspec = specs[rtype]
    template = rspec.get("template") or {}
    meta = copy.deepcopy(template.get("metadata") or {})
    meta["labels"] = {
        **(meta.get("labels") or {}),
        "training.kubeflow.org/operator-name": "pytorchjob-controller",
        "training.kubeflow.org/job-name": name,
        "training.kubeflow.org/replica-type": rtype.lower(),
        "training.kubeflow.org/replica-index": str(index),
        **({"training.kubeflow.org/job-role": "master"} if rtype == "Master" else {}),
    }
    meta.update(name=f"{name}-{rtype.lower()}-{index}", namespace=ns, ownerReferences=[ref])
    spec = copy.deepcopy(template.get("spec") or {})
    policy = rspec.get("restartPolicy", "Never")
    spec["restartPolicy"] = "Never" if policy == "ExitCode" else policy
    replicas = sum(int(s.get("replicas", 1)) for s in specs.values())
    nproc = str(pj["spec"].get("nprocPerNode") or "1")
    env = [{"name": "PYTHONUNBUFFERED", "value": "0"}]
    if "Master" in specs:
        port = next(
            (
                p["containerPort"]
                for c in (specs["Master"].get("template") or {}).get("spec", {})["containers"]
                for p in c.get("ports") or []
                if p.get("name") == "pytorchjob-port"
            ),
            PYTORCHJOB_PORT,
        )
        rank = index + 1 if rtype == "Worker" else index
        world = replicas * (int(nproc) if nproc.isdigit() else 1)
        env += [
            {"name": "MASTER_PORT", "value": str(port)},
            {"name": "PET_MASTER_PORT", "value": str(port)},
            {"name": "MASTER_ADDR", "value": f"{name}-master-0"},
            {"name": "PET_MASTER_ADDR", "value": f"{name}-master-0"},
            {"name": "WORLD_SIZE", "value": str(world)},
            {"name": "RANK", "value": str(rank)},
            {"name": "PET_NPROC_PER_NODE", "value": nproc},
            {"name": "PET_NODE_RANK", "value": str(rank)},
        ]
    if not pj["spec"].get("elasticPolicy"):
        env.append({"name": "PET_NNODES", "value": str(replicas)})
    for container in spec.get("containers") or []:
        container["env"] = [*(container.get("env") or []), *env]
    return {"metadata": meta, "spec": spec}
