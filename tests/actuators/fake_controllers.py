"""The fake cluster's Job, JobSet and PyTorchJob (training operator) controllers and its
scheduler (a mixin of :class:`tests.actuators.fake_cluster.FakeCluster`), enough for gang
restarts: :meth:`WorkloadControllers.reconcile_pytorchjob` recreates a PyTorchJob's missing
pods from its current spec; a deleted or
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
        """One reconcile of the training operator: create every replica's missing pod
        (``<job>-<type>-<index>``, scheduled) from the current spec, delete pods past the
        replica counts; nothing while ``runPolicy.suspend``. Returns the pods created."""
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
                k[3]
                for k, p in self.objects.items()
                if k[:3] == ("", "pods", ns) and any(r.get("uid") == ref["uid"] for r in _refs(p))
            }
            wanted: set[str] = set()
            created: list[str] = []
            for rtype, rspec in sorted(pj["spec"]["pytorchReplicaSpecs"].items()):
                template = rspec.get("template") or {}
                for index in range(int(rspec.get("replicas", 1))):
                    pod_name = f"{name}-{rtype.lower()}-{index}"
                    wanted.add(pod_name)
                    if pod_name in ours:
                        continue
                    meta = copy.deepcopy(template.get("metadata") or {})
                    meta["labels"] = {
                        **(meta.get("labels") or {}),
                        "training.kubeflow.org/job-name": name,
                        "training.kubeflow.org/replica-type": rtype.lower(),
                        "training.kubeflow.org/replica-index": str(index),
                    }
                    meta.update(name=pod_name, namespace=ns, ownerReferences=[ref])
                    pod = {"metadata": meta, "spec": copy.deepcopy(template.get("spec") or {})}
                    pod["spec"]["nodeName"] = self.schedule(pod)
                    pod["status"] = {"phase": "Running" if pod["spec"]["nodeName"] else "Pending"}
                    self.put("", "pods", pod)
                    created.append(pod_name)
            for extra in sorted(ours - wanted):
                self._delete(("", "pods", ns, extra), {}, None)
            return created
