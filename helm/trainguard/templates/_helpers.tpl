{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "trainguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: <release>-<chart>, or the release name when it already holds the chart name. */}}
{{- define "trainguard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* <fullname>-<suffix> within the 63 characters of a DNS label (Service, Job, pod label
values): (dict "root" $ "suffix" "agent"). The full name is shortened, never the suffix, so
a long release's "-agent" or "-leader-hook" object cannot be cut back to the controller's
own name (same kind, same namespace: one would overwrite the other). */}}
{{- define "trainguard.suffixedName" -}}
{{- $base := include "trainguard.fullname" .root | trunc (int (sub 62 (len .suffix))) | trimSuffix "-" -}}
{{- printf "%s-%s" $base .suffix -}}
{{- end -}}

{{- define "trainguard.agentName" -}}
{{- include "trainguard.suffixedName" (dict "root" . "suffix" "agent") -}}
{{- end -}}

{{- define "trainguard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "trainguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: trainguard
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "trainguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trainguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "trainguard.controllerSelectorLabels" -}}
{{ include "trainguard.selectorLabels" . }}
app.kubernetes.io/component: controller
{{- end -}}

{{- define "trainguard.agentSelectorLabels" -}}
{{ include "trainguard.selectorLabels" . }}
app.kubernetes.io/component: agent
{{- end -}}

{{- define "trainguard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "trainguard.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image reference: (dict "root" $ "image" <controller.image or agent.image>) ->
[registry/]name@digest when the component's digest is set, else [registry/]name:tag. */}}
{{- define "trainguard.imageRef" -}}
{{- $root := .root -}}
{{- $name := .image.repository -}}
{{- with $root.Values.image.registry }}{{ $name = printf "%s/%s" (trimSuffix "/" .) $name }}{{ end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $name .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $name (default $root.Chart.AppVersion $root.Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The controller image (Dockerfile target `controller`); the migration Job uses it too. */}}
{{- define "trainguard.controllerImage" -}}
{{- include "trainguard.imageRef" (dict "root" . "image" .Values.controller.image) -}}
{{- end -}}

{{/* The agent image (Dockerfile target `agent`). */}}
{{- define "trainguard.agentImage" -}}
{{- include "trainguard.imageRef" (dict "root" . "image" .Values.agent.image) -}}
{{- end -}}

{{/* true when the controller pods carry the leader label and the Service selects it. */}}
{{- define "trainguard.leaderLabel" -}}
{{- if and (include "trainguard.usesPostgres" .) .Values.controller.leaderLabel.enabled -}}true{{- end -}}
{{- end -}}

{{/* true where the cluster serves the Prometheus Operator's API (ServiceMonitor, PrometheusRule). */}}
{{- define "trainguard.hasPrometheusOperator" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- end -}}

{{- define "trainguard.jobNamespace" -}}
{{- default .Release.Namespace .Values.controller.jobNamespace -}}
{{- end -}}

{{/* The Secret with tokens (and, when the chart holds it, the database URL). */}}
{{- define "trainguard.secretName" -}}
{{- default (include "trainguard.fullname" .) .Values.auth.existingSecret -}}
{{- end -}}

{{/* true when the controller uses PostgreSQL (a URL in values or an existing Secret). */}}
{{- define "trainguard.usesPostgres" -}}
{{- if or .Values.database.url .Values.database.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* The plaintext agent token from values: auth.agentToken, else the first agent-role token. */}}
{{- define "trainguard.agentToken" -}}
{{- $token := .Values.auth.agentToken -}}
{{- if not $token -}}
{{- range .Values.auth.tokens -}}
{{- if and (not $token) (eq .role "agent") .token -}}
{{- $token = .token -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $token -}}
{{- end -}}

{{/* The Secret (release namespace, key `token`) with the job token(s) the agents accept. */}}
{{- define "trainguard.jobTokenSecret" -}}
{{- default (printf "%s-job-token" (include "trainguard.fullname" .)) .Values.agent.jobEndpoint.existingSecret -}}
{{- end -}}

{{/* Refuse values that would render an unusable release, each with a message that says
what to set. Included by every workload template. */}}
{{- define "trainguard.validate" -}}
{{- if and (not .Values.auth.existingSecret) (not .Values.auth.tokens) -}}
{{- fail "auth.tokens is empty and auth.existingSecret is not set: give at least one API token (auth.tokens: [{name: agents, role: agent, token: <openssl rand -hex 24>}, ...]) or the name of a Secret with keys `tokens` and `agent-token` (auth.existingSecret)" -}}
{{- end -}}
{{- if and .Values.agent.enabled (ne .Values.auth.agentIdentity "serviceAccountToken") (not .Values.auth.existingSecret) (not (include "trainguard.agentToken" .)) -}}
{{- fail "the agents need a plaintext agent-role token: add an entry with role: agent and token: ... to auth.tokens, or set auth.agentToken (or agent.enabled: false)" -}}
{{- end -}}
{{- if and (gt (int .Values.controller.replicas) 1) (not (include "trainguard.usesPostgres" .)) -}}
{{- fail "controller.replicas > 1 needs PostgreSQL (database.url or database.existingSecret): replicas on the embedded SQLite database cannot share it" -}}
{{- end -}}
{{- if and .Values.agent.enabled (ge (int .Values.agent.metrics.port) 1) (eq (int .Values.agent.metrics.port) (int .Values.agent.jobEndpoint.port)) -}}
{{- fail (printf "agent.metrics.port and agent.jobEndpoint.port are both %d: the agent cannot listen twice on one port; give the metrics exporter another port (or -1 to turn it off)" (int .Values.agent.metrics.port)) -}}
{{- end -}}
{{- if eq (include "trainguard.agentName" .) (include "trainguard.fullname" .) -}}
{{- fail (printf "the agents' objects would be named %q like the controller's: shorten fullnameOverride (or nameOverride) so it does not end in \"-agent\" at 62 characters" (include "trainguard.fullname" .)) -}}
{{- end -}}
{{- if and .Values.image.tag (hasPrefix "sha256:" .Values.image.tag) -}}
{{- fail "image.tag holds a tag, not a digest: set controller.image.digest and agent.image.digest (sha256:<64 hex>) instead" -}}
{{- end -}}
{{- end -}}

{{/* An alert's runbook annotations: (dict "r" .Values.prometheusRule "alert" NAME). */}}
{{- define "trainguard.runbook" -}}
runbook: {{ printf "docs/runbook.md#%s" (lower .alert) | quote }}
{{- with .r.runbookBaseUrl }}
runbook_url: {{ printf "%s#%s" . (lower $.alert) | quote }}
{{- end }}
{{- end -}}

{{/* The controller pods' selector as a label-selector string (a=b,c=d), for leader-label. */}}
{{- define "trainguard.controllerSelector" -}}
{{- $pairs := list -}}
{{- range $k, $v := (include "trainguard.controllerSelectorLabels" . | fromYaml) -}}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* The leader-label command, sidecar or hook: (dict "root" $ "once" bool). */}}
{{- define "trainguard.leaderLabelCommand" -}}
- trainguard
- leader-label
- --selector
- {{ include "trainguard.controllerSelector" .root | quote }}
- --port
- "8470"
- --interval
- {{ .root.Values.controller.leaderLabel.intervalSeconds | quote }}
{{- if .once }}
- --once
{{- end }}
{{- end -}}
