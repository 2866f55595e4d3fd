{{/* Environment shared by the controller container and its migration init container.
Secrets arrive only through secretKeyRef. */}}
{{- define "trainguard.controllerEnv" -}}
- name: TRAINGUARD_TOKENS
  valueFrom:
    secretKeyRef:
      name: {{ include "trainguard.secretName" . }}
      key: tokens
- name: TRAINGUARD_DATABASE_URL
{{- if include "trainguard.usesPostgres" . }}
  valueFrom:
    secretKeyRef:
      {{- if .Values.database.existingSecret }}
      name: {{ .Values.database.existingSecret }}
      key: {{ .Values.database.existingSecretKey }}
      {{- else }}
      name: {{ include "trainguard.fullname" . }}
      key: database-url
      {{- end }}
{{- else }}
  value: {{ printf "sqlite:///%s" .Values.database.sqlite.path | quote }}
{{- end }}
- name: TRAINGUARD_LOG_LEVEL
  value: {{ .Values.controller.logLevel | quote }}
- name: HOME
  value: /tmp
{{- if .Values.controller.config }}
- name: TRAINGUARD_CONFIG_FILE
  value: /etc/trainguard/config.yaml
{{- end }}
{{- end -}}
