{{/* Name of the chart, overridable. */}}
{{- define "podmotion.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: release-chart, unless the release name already contains the chart name. */}}
{{- define "podmotion.fullname" -}}
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

{{/* Namespace of the migration agents and the attachment Jobs. */}}
{{- define "podmotion.agentNamespace" -}}
{{- default (printf "%s-agents" .Release.Namespace) .Values.agents.namespace | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "podmotion.operatorServiceAccount" -}}
{{- default (include "podmotion.fullname" .) .Values.operator.serviceAccount.name -}}
{{- end -}}

{{- define "podmotion.agentName" -}}
{{- printf "%s-migration-agent" (include "podmotion.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object of the chart. */}}
{{- define "podmotion.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "podmotion.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: podmotion
{{- end -}}

{{- define "podmotion.operatorSelector" -}}
app.kubernetes.io/name: {{ include "podmotion.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "podmotion.agentSelector" -}}
app.kubernetes.io/name: {{ include "podmotion.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: migration-agent
{{- end -}}

{{/* The attach agents' pods, as the operator labels them (operator/core/src/attachment/
     render.rs agent_selector_labels): no release label, the agents' namespace tells
     the releases apart. */}}
{{- define "podmotion.attachAgentSelector" -}}
app.kubernetes.io/managed-by: podmotion
app.kubernetes.io/component: node-agent
{{- end -}}

{{/* repository:tag or repository@digest. Argument: dict "image" <image values> "root" $ */}}
{{- define "podmotion.image" -}}
{{- $img := .image -}}
{{- $ref := "" -}}
{{- if $img.digest -}}
{{- $ref = printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- $ref = printf "%s:%s" $img.repository (default .root.Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- include "podmotion.fromRegistry" (dict "ref" $ref "root" .root) -}}
{{- end -}}

{{/* A pod's nodeSelector: the `selector` the values give, and the platform PodMotion's
     images are built for (`kubernetes.io/os: linux`, `kubernetes.io/arch:
     global.nodeArch`), so no pod lands on a node its image cannot run on (a Windows or
     arm64 node would crash-loop it). The values' own keys win. */}}
{{- define "podmotion.nodeSelector" -}}
{{- $platform := dict "kubernetes.io/os" "linux" -}}
{{- with ((.root.Values.global | default dict).nodeArch) -}}
{{- $_ := set $platform "kubernetes.io/arch" . -}}
{{- end -}}
{{- toYaml (merge (deepCopy (.selector | default dict)) $platform) -}}
{{- end -}}

{{/* An image reference (`ref`) pulled from `global.imageRegistry` when that is set:
     the registry the reference names (its first path element when that has a `.` or
     a `:` or is `localhost`) replaced, or prepended when it names none. One rule for
     every image PodMotion runs or has the operator run (attachment Jobs, the
     preflight, the holder), so a mirror needs one value. */}}
{{- define "podmotion.fromRegistry" -}}
{{- $registry := trimSuffix "/" (((.root.Values.global | default dict).imageRegistry) | default "") -}}
{{- if $registry -}}
{{- $parts := splitList "/" .ref -}}
{{- $first := first $parts -}}
{{- if and (gt (len $parts) 1) (or (contains "." $first) (contains ":" $first) (eq $first "localhost")) -}}
{{- printf "%s/%s" $registry (join "/" (rest $parts)) -}}
{{- else -}}
{{- printf "%s/%s" $registry .ref -}}
{{- end -}}
{{- else -}}
{{- .ref -}}
{{- end -}}
{{- end -}}

{{/* The operator's flags, one per line of a YAML list; every flag of
     operator/src/config.rs and main.rs has a value in values.yaml. */}}
{{- define "podmotion.operatorArgs" -}}
- --namespace=$(POD_NAMESPACE)
- --identity=$(POD_NAME)
- --controllers={{ join "," .Values.operator.controllers }}
- --http-addr=0.0.0.0:{{ .Values.operator.httpPort }}
- --concurrency={{ .Values.operator.concurrency }}
- --log-format={{ include "podmotion.operatorLogFormat" . }}
{{- /* The platform of the pods the operator renders (attachment Jobs, RunnerPool
     preflights), as `podmotion.nodeSelector` gives the chart's own; empty: any
     architecture. */}}
- --node-arch={{ (.Values.global | default dict).nodeArch | default "" }}
{{- /* Always: with the namespace it names the release that objects are claimed for
     (the `podmotion.io/controller` annotation), leader election or not. */}}
- --leader-lease-name={{ .Values.operator.leaderElection.leaseName }}
{{- if .Values.operator.leaderElection.enabled }}
- --leader-lease-seconds={{ .Values.operator.leaderElection.leaseSeconds }}
{{- else }}
- --no-leader-election
{{- end }}
{{- if has "migration" .Values.operator.controllers }}
{{- /* A file, not an environment variable: the key never shows in the pod spec. */}}
{{- if .Values.migration.masterKey.existingSecret }}
- --migration-key-file={{ include "podmotion.migrationKeyDir" . }}/key
{{- else }}
{{- /* Made by the operator at run time (never by Helm), read through the API. */}}
- --migration-key-secret={{ include "podmotion.migrationKeySecret" . }}
{{- end }}
{{- end }}
- --key-material-dir=/run/podmotion/keys
{{- if and (has "migration" .Values.operator.controllers) .Values.migrationAgent.enabled }}
{{- $pki := .Values.migrationAgent.pki }}
{{- /* Run-time key material of the agents' mutual TLS (operator/src/pki). */}}
- --pki-ca-secret={{ include "podmotion.caSecret" . }}
- --pki-bundle-configmap={{ include "podmotion.caBundleConfigMap" . }}
- --pki-agent-service-account={{ include "podmotion.agentName" . }}
- --pki-ca-seconds={{ mul (int $pki.caValidityDays) 86400 }}
- --pki-leaf-seconds={{ mul (int $pki.leafValidityHours) 3600 }}
- --pki-propagation-seconds={{ $pki.propagationSeconds }}
- --pki-key-material-policy={{ include "podmotion.fullname" . }}-key-material
{{- end }}
{{- end -}}

{{/* Environment shared by the operator and its hook. The controllers' own settings
     are passed as environment variables: each flag of operator/src/controllers/*.rs
     falls back to one, whether or not the binary exposes the flag yet. */}}
{{- define "podmotion.operatorEnv" -}}
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: RUST_LOG
  value: {{ include "podmotion.operatorLogFilter" . | quote }}
{{- /* PodMigration (--migration-*) */}}
- name: PODMOTION_AGENT_NAMESPACE
  value: {{ include "podmotion.agentNamespace" . | quote }}
- name: PODMOTION_AGENT_SELECTOR
  value: {{ printf "app.kubernetes.io/component=migration-agent,app.kubernetes.io/instance=%s" .Release.Name | quote }}
- name: PODMOTION_AGENT_PORT
  value: {{ .Values.migrationAgent.grpcPort | quote }}
{{- with .Values.migration.agentEndpoints }}
- name: PODMOTION_AGENT_ENDPOINTS
  value: {{ join "," . | quote }}
{{- end }}
{{- with .Values.migration.watchNamespace }}
- name: PODMOTION_MIGRATION_NAMESPACE
  value: {{ . | quote }}
{{- end }}
- name: PODMOTION_MIGRATION_MAX_PARALLEL
  value: {{ .Values.migration.maxParallel | quote }}
- name: PODMOTION_MIGRATION_MAX_PER_NODE
  value: {{ .Values.migration.maxPerNode | quote }}
- name: PODMOTION_MIGRATION_AGENT_CALL_TIMEOUT_SECONDS
  value: {{ .Values.migration.agentCallTimeoutSeconds | quote }}
- name: PODMOTION_MIGRATION_SERVICE_SYNC_MILLIS
  value: {{ .Values.migration.serviceSyncMillis | int64 | quote }}
- name: PODMOTION_MIGRATION_FORWARD_NEW_CONNECTIONS
  value: {{ .Values.migration.forwardNewConnections | quote }}
{{- /* --migration-exec-probes: the RBAC grants pods/exec only when it is true. */}}
- name: PODMOTION_MIGRATION_EXEC_PROBES
  value: {{ .Values.migration.execProbes.enabled | quote }}
- name: PODMOTION_HOLDER_IMAGE
  value: {{ with .Values.migration.holderImage }}{{ include "podmotion.fromRegistry" (dict "ref" . "root" $) | quote }}{{ else }}{{ include "podmotion.image" (dict "image" .Values.migrationAgent.agent.image "root" $) | quote }}{{ end }}
{{- /* RunnerPool (environment only) */}}
- name: PODMOTION_PREFLIGHT_IMAGE
  value: {{ include "podmotion.fromRegistry" (dict "ref" (.Values.runnerPool.preflightImage | default (printf "ghcr.io/podmotion/podmotion-preflight:%s" .Chart.AppVersion)) "root" $) | quote }}
- name: PODMOTION_RUNNER_POOL_MAX_PRIORITY
  value: {{ .Values.runnerPool.maxPriority | int64 | quote }}
{{- with .Values.runnerPool.watchNamespace }}
- name: PODMOTION_RUNNER_POOL_NAMESPACE
  value: {{ . | quote }}
{{- end }}
{{- /* NodeAgentAttachment (--attachment-*). Its Jobs belong in the agents' namespace
       (privileged Pod Security), not in the operator's (restricted). */}}
- name: PODMOTION_ATTACHMENT_NAMESPACE
  value: {{ include "podmotion.agentNamespace" . | quote }}
- name: PODMOTION_ATTACHMENT_JOB_PREFIX
  value: {{ .Values.attachment.jobPrefix | quote }}
- name: PODMOTION_ATTACHMENT_AGENT_IMAGE
  value: {{ include "podmotion.fromRegistry" (dict "ref" (.Values.attachment.agentImage | default (printf "ghcr.io/podmotion/podmotion-attach:%s" .Chart.AppVersion)) "root" $) | quote }}
- name: PODMOTION_ATTACHMENT_CRI_SOCKET_PATH
  value: {{ .Values.attachment.criSocketPath | quote }}
- name: PODMOTION_ATTACHMENT_POD_ANNOTATIONS
  value: {{ toJson (.Values.attachment.podAnnotations | default dict) | quote }}
- name: PODMOTION_ATTACHMENT_SWEEP_SECONDS
  value: {{ .Values.attachment.sweepSeconds | quote }}
- name: PODMOTION_ATTACHMENT_WRITE_PARALLELISM
  value: {{ .Values.attachment.writeParallelism | quote }}
- name: PODMOTION_ATTACHMENT_BACKOFF_LIMIT
  value: {{ .Values.attachment.backoffLimit | quote }}
- name: PODMOTION_ATTACHMENT_METRICS_PORT
  value: {{ .Values.attachment.metricsPort | quote }}
- name: PODMOTION_ATTACHMENT_CONTROL_PORT
  value: {{ .Values.attachment.controlPort | quote }}
- name: PODMOTION_ATTACHMENT_MAX_WIRETAPS
  value: {{ .Values.attachment.maxWiretaps | quote }}
{{- with .Values.imagePullSecrets }}
{{- $names := list }}
{{- range . }}{{ $names = append $names .name }}{{ end }}
- name: PODMOTION_ATTACHMENT_IMAGE_PULL_SECRETS
  value: {{ join "," $names | quote }}
{{- end }}
{{- with .Values.attachment.watchNamespace }}
- name: PODMOTION_ATTACHMENT_WATCH_NAMESPACE
  value: {{ . | quote }}
{{- end }}
{{- /* The pods/eviction webhook (templates/eviction-webhook.yaml). */}}
{{ include "podmotion.evictionEnv" . }}
{{- end -}}

{{/* Secret in the release namespace holding the agents' CA (made and rotated by the
     operator at run time; never rendered by the chart). */}}
{{- define "podmotion.caSecret" -}}
{{- printf "%s-agent-ca" (include "podmotion.fullname" .) -}}
{{- end -}}

{{/* ConfigMap in the agents' namespace holding the CA bundle the agents trust
     (published by the operator). */}}
{{- define "podmotion.caBundleConfigMap" -}}
{{- printf "%s-agent-ca" (include "podmotion.fullname" .) -}}
{{- end -}}

{{/* Secret in the release namespace holding the migration master key (entry `key`):
     the user's, mounted as a file, or the operator's, created at run time. */}}
{{- define "podmotion.migrationKeySecret" -}}
{{- default (printf "%s-migration-key" (include "podmotion.fullname" .)) .Values.migration.masterKey.existingSecret -}}
{{- end -}}

{{/* Where the operator mounts it. */}}
{{- define "podmotion.migrationKeyDir" -}}
/etc/podmotion/migration-key
{{- end -}}

{{/* Whether a Prometheus Operator object is rendered: its `enabled` is true, or "auto"
     and the API server serves its kind, monitoring.coreos.com/v1/<kind> (helm
     install/upgrade ask the cluster, which lists each kind; `helm template` needs
     --api-versions monitoring.coreos.com/v1/<kind>, as Argo CD passes them). The group
     alone is not enough: a cluster may serve ServiceMonitor and PodMonitor without
     PrometheusRule. Argument: dict "enabled" <value> "kind" <Kind> "root" $. Returns
     "true" or "". */}}
{{- define "podmotion.prometheusOperatorObject" -}}
{{- $v := .enabled -}}
{{- if kindIs "bool" $v -}}
{{- if $v }}true{{ end -}}
{{- else if eq (toString $v) "auto" -}}
{{- if .root.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" (required "podmotion.prometheusOperatorObject: kind" .kind)) }}true{{ end -}}
{{- else -}}
{{- fail (printf "metrics: enabled must be true, false or \"auto\", not %v" $v) -}}
{{- end -}}
{{- end -}}

{{/* A component's log level: its own `logLevel` (`own`) when set, else the
     chart-wide `logLevel`. */}}
{{- define "podmotion.logLevel" -}}
{{- default .root.Values.logLevel .own -}}
{{- end -}}

{{/* The operator's tracing filter (`RUST_LOG`): `operator.logFilter` when set, else
     its level with the kube client at `warn` (its `info` is a line per request), or
     `error` alone. */}}
{{- define "podmotion.operatorLogFilter" -}}
{{- if .Values.operator.logFilter -}}
{{- .Values.operator.logFilter -}}
{{- else -}}
{{- $level := include "podmotion.logLevel" (dict "own" .Values.operator.logLevel "root" .) -}}
{{- if eq $level "error" }}error{{ else }}{{ $level }},kube=warn{{ end -}}
{{- end -}}
{{- end -}}

{{/* The operator's log format: `operator.logFormat` when set (deprecated), else the
     chart-wide `logFormat` every component uses. */}}
{{- define "podmotion.operatorLogFormat" -}}
{{- default .Values.logFormat .Values.operator.logFormat -}}
{{- end -}}

{{/*
The migration broker's host directory (netns mount points and its lock journal): one
per release unless migrationAgent.netnsDir names one, so two releases' brokers on a node
never roll back or unbind each other's migrations.
*/}}
{{- define "podmotion.netnsDir" -}}
{{- .Values.migrationAgent.netnsDir | default (printf "/run/podmotion/%s.%s/netns" .Release.Namespace .Release.Name) -}}
{{- end }}
