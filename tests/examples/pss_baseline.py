"""The Pod Security Standards ``baseline`` level as a checker of a pod spec.

Written from the published controls (kubernetes.io/docs/concepts/security/pod-security-standards,
"Baseline" table, Kubernetes 1.33), so a test can say which example pod would be refused by a
namespace labelled ``pod-security.kubernetes.io/enforce: baseline`` and why.
"""

from __future__ import annotations

from typing import Any

#: Capabilities a baseline pod may add (the container runtime's default set).
ALLOWED_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
        "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
    }
)  # fmt: skip
#: Namespaced sysctls isolated from the node.
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes",
    }
)  # fmt: skip
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t",
                           "container_engine_t"})  # fmt: skip
APPARMOR_TYPES = frozenset({"RuntimeDefault", "Localhost"})


def _security_contexts(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = [("spec.securityContext", pod.get("securityContext") or {})]
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for container in pod.get(group) or []:
            where = f"{group}[{container.get('name')}]"
            out.append((where, container.get("securityContext") or {}))
    return out


def baseline_violations(
    pod: dict[str, Any], annotations: dict[str, str] | None = None
) -> list[str]:
    """Every baseline control ``pod`` (a PodSpec as a dict) breaks; empty when admitted."""
    errors: list[str] = []
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            errors.append(f"AppArmor: annotation {key}={value}")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            errors.append(f"host namespaces: {field}=true")
    for volume in pod.get("volumes") or []:
        if "hostPath" in volume:
            errors.append(f"hostPath volumes: volume {volume.get('name')!r}")
    for sysctl in (pod.get("securityContext") or {}).get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            errors.append(f"sysctls: {sysctl.get('name')}")
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for container in pod.get(group) or []:
            for port in container.get("ports") or []:
                if port.get("hostPort"):
                    name, host_port = container.get("name"), port["hostPort"]
                    errors.append(f"host ports: {name} hostPort {host_port}")
    for where, ctx in _security_contexts(pod):
        if (ctx.get("windowsOptions") or {}).get("hostProcess"):
            errors.append(f"HostProcess: {where}")
        if ctx.get("privileged"):
            errors.append(f"privileged containers: {where}")
        added = set((ctx.get("capabilities") or {}).get("add") or []) - ALLOWED_CAPABILITIES
        if added:
            errors.append(f"capabilities: {where} adds {sorted(added)}")
        apparmor = ctx.get("appArmorProfile") or {}
        if apparmor and apparmor.get("type") not in APPARMOR_TYPES:
            errors.append(f"AppArmor: {where} {apparmor.get('type')}")
        selinux = ctx.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or "user" in selinux or "role" in selinux:
            errors.append(f"SELinux: {where} {selinux}")
        if ctx.get("procMount", "Default") != "Default":
            errors.append(f"/proc mount type: {where} {ctx['procMount']}")
        if (ctx.get("seccompProfile") or {}).get("type") == "Unconfined":
            errors.append(f"seccomp: {where} Unconfined")
    return errors


__all__ = ["baseline_violations"]
