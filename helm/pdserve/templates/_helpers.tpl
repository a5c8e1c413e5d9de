{{/*
Names, labels and the pieces every pdserve pod shares: image, env, model volumes.
*/}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name of one component's objects: <fullname>-<component>. */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component; call with (dict "root" $ "component" "gateway"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" .root }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
A config value as an env-var string. Helm reads YAML numbers as float64, which would
print 17179869184 as 1.7179869184e+10: integral floats are printed as integers.
*/}}
{{- define "pdserve.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}
{{- printf "%d" (int64 .) }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/* PDSERVE_MODEL / PDSERVE_MODEL_CACHE_DIR entries for a config dict. */}}
{{- define "pdserve.modelDir" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "image" }}
{{- "" }}
{{- else if $m.path }}
{{- printf "%s/%s" (trimSuffix "/" $m.mountPath) (trimPrefix "/" $m.path) }}
{{- else }}
{{- $m.mountPath }}
{{- end }}
{{- end }}

{{/*
The ConfigMap data of one component: chart-managed settings first, then the shared
sections, then the component's own `config` (later layers win). Call with
(dict "root" $ "component" NAME "base" DICT "layers" LIST).
*/}}
{{- define "pdserve.configData" -}}
{{- $cfg := deepCopy .base }}
{{- range .layers }}
{{- range $k, $v := . }}
{{- $_ := set $cfg $k $v }}
{{- end }}
{{- end }}
{{- range $k, $v := $cfg }}
{{- if not (kindIs "invalid" $v) }}
{{ printf "PDSERVE_%s" (upper $k) }}: {{ include "pdserve.envValue" $v | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Settings every component shares (the model, the Redis key prefix, heartbeats). */}}
{{- define "pdserve.sharedConfig" -}}
{{- $cfg := dict "namespace" .Values.cluster.redisNamespace "heartbeat_ttl_s" .Values.cluster.heartbeatTtlS "block_size" .Values.cluster.blockSize }}
{{- toYaml $cfg }}
{{- end }}

{{/* Mode sentinel: every Sentinel pod by its stable name, and the service they watch. */}}
{{- define "pdserve.sentinelUrl" -}}
{{- $name := include "pdserve.componentName" (dict "root" . "component" "sentinel") }}
{{- $hosts := list }}
{{- range $i := until (int .Values.redis.sentinel.sentinels) }}
{{- $hosts = append $hosts (printf "%s-%d.%s:%d" $name $i $name (int $.Values.redis.sentinel.sentinelPort)) }}
{{- end }}
{{- printf "redis+sentinel://%s/pdserve/0" (join "," $hosts) }}
{{- end }}

{{/* The PDSERVE_REDIS_URL env entry: the built-in Service, the Sentinels, or the URL's Secret. */}}
{{- define "pdserve.redisUrlEnv" -}}
- name: PDSERVE_REDIS_URL
{{- if eq .Values.redis.mode "builtin" }}
  value: {{ printf "redis://%s:%d/0" (include "pdserve.componentName" (dict "root" . "component" "redis")) (int .Values.redis.builtin.port) | quote }}
{{- else if eq .Values.redis.mode "sentinel" }}
  value: {{ include "pdserve.sentinelUrl" . | quote }}
{{- else }}
  valueFrom:
    secretKeyRef:
      {{- if .Values.redis.external.existingSecret }}
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
      {{- else }}
      name: {{ include "pdserve.componentName" (dict "root" . "component" "redis-url") }}
      key: redis-url
      {{- end }}
{{- end }}
{{- end }}

{{/* Env every pdserve container gets: pod identity, the OTLP collector, the Redis URL. */}}
{{- define "pdserve.commonEnv" -}}
{{- if .root.Values.tracing.otlpEndpoint }}
- name: PDSERVE_OTLP_ENDPOINT
  value: {{ .root.Values.tracing.otlpEndpoint | quote }}
- name: PDSERVE_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end }}
{{ include "pdserve.redisUrlEnv" .root }}
{{- end }}

{{/* Volumes for the model and the external Redis CA (every pdserve pod). */}}
{{- define "pdserve.volumes" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" $m.pvc.claimName }}
    readOnly: {{ $m.pvc.readOnly }}
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "initContainer" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.emptyDirSizeLimit }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tls.caSecret }}
- name: redis-tls
  secret:
    secretName: {{ .Values.redis.external.tls.caSecret }}
    items:
      - key: {{ .Values.redis.external.tls.caKey }}
        path: ca.crt
{{- end }}
{{- end }}

{{- define "pdserve.volumeMounts" -}}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ ne .Values.model.source "initContainer" }}
{{- end }}
- name: tmp
  mountPath: /tmp
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tls.caSecret }}
- name: redis-tls
  mountPath: /etc/pdserve/redis-tls
  readOnly: true
{{- end }}
{{- end }}

{{/* The init container that fills the model emptyDir (model.source initContainer). */}}
{{- define "pdserve.initContainers" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "initContainer" }}
- name: fetch-model
  image: {{ $m.initContainer.image | default (include "pdserve.image" .) }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: {{ required "model.initContainer.command is required when model.source is initContainer" $m.initContainer.command | toJson }}
  {{- with $m.initContainer.args }}
  args: {{ toJson . }}
  {{- end }}
  env:
    - name: MODEL_DIR
      value: {{ include "pdserve.modelDir" . | quote }}
    {{- with $m.initContainer.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $m.initContainer.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* gRPC startup, readiness and liveness probes on the standard health service. */}}
{{- define "pdserve.grpcProbes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 10
  failureThreshold: {{ .startupFailureThreshold }}
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 5
  timeoutSeconds: 2
  failureThreshold: 2
livenessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}

{{/*
Scheduling fields of one component's pod spec. Call with the component's values merged
into (dict "ctx" (dict "root" $ "component" NAME)). A topology spread constraint without
a labelSelector gets the component's selector labels, so it spreads this pool's pods.
*/}}
{{- define "pdserve.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .topologySpreadConstraints }}
{{- $selector := include "pdserve.selectorLabels" .ctx | fromYaml }}
topologySpreadConstraints:
{{- range .topologySpreadConstraints }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" $selector) }}
{{- end }}
  - {{ toYaml $c | nindent 4 | trim }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The ConfigMap data of each component, keyed by component. Call with the root context
and the component name; returns the `PDSERVE_*: "value"` lines.
*/}}
{{- define "pdserve.componentConfig" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $shared := include "pdserve.sharedConfig" $root | fromYaml }}
{{- $model := dict "model_cache_dir" $v.model.cacheDir }}
{{- with include "pdserve.modelDir" $root }}
{{- $_ := set $model "model" . }}
{{- end }}
{{- $base := merge (dict) $shared $model }}
{{- $layers := list }}
{{- if eq .component "gateway" }}
{{- $_ := set $base "gateway_host" "0.0.0.0" }}
{{- $_ := set $base "gateway_port" $v.ports.gateway }}
{{- $_ := set $base "placement" "redis" }}
{{- $_ := set $base "http_port" ($v.gateway.http.enabled | ternary $v.gateway.http.port -1) }}
{{- $layers = list $v.routing $v.tracing.config $v.metrics.config $v.gateway.config }}
{{- else if eq .component "router" }}
{{- $base = $shared }}
{{- $layers = list $v.routing $v.tracing.config $v.metrics.config $v.router.config }}
{{- else }}
{{- $pool := index $v .component }}
{{- $_ := set $base "role" (include "pdserve.workerRole" .) }}
{{- $_ := set $base "port" $v.ports.worker }}
{{- $_ := set $base "kv_transfer_port" $v.ports.kvTransfer }}
{{- $_ := set $base "kv_backend" $v.kvTransfer.backend }}
{{- $_ := set $base "drain_timeout_s" $pool.drainTimeoutS }}
{{- $_ := set $base "device" (gt (int $pool.gpus) 0 | ternary "cuda" "cpu") }}
{{- $layers = list $v.tracing.config $v.metrics.config $pool.config }}
{{- end }}
{{- if $v.metrics.enabled }}
{{- $_ := set $base "metrics_host" "0.0.0.0" }}
{{- $_ := set $base "metrics_port" $v.metrics.port }}
{{- end }}
{{- include "pdserve.configData" (dict "base" $base "layers" $layers) }}
{{- end }}

{{/*
The role a pool's workers run: its own name, or `mixed` for the decode pool when there
is no prefill pool. Call with (dict "root" $ "component" "prefill"|"decode").
*/}}
{{- define "pdserve.workerRole" -}}
{{- if and (eq .component "decode") (not .root.Values.prefill.enabled) }}
{{- "mixed" }}
{{- else }}
{{- .component }}
{{- end }}
{{- end }}

{{/*
PromQL label matchers for the series scraped from one component's Service, e.g.
namespace="serving",service="rel-pdserve-gateway". The label names are
metrics.seriesLabels (what a ServiceMonitor sets). Call with (dict "root" $ "component"
NAME); a list in "components" matches any of those Services.
*/}}
{{- define "pdserve.seriesSelector" -}}
{{- $labels := .root.Values.metrics.seriesLabels }}
{{- $names := list }}
{{- range (.components | default (list .component)) }}
{{- $names = append $names (include "pdserve.componentName" (dict "root" $.root "component" .)) }}
{{- end }}
{{- $op := ternary "=~" "=" (gt (len $names) 1) }}
{{- printf "%s=%q,%s%s%q" $labels.namespace .root.Release.Namespace $labels.service $op (join "|" $names) }}
{{- end }}

{{/* The worker pools the chart runs: (list "prefill" "decode") or (list "decode"). */}}
{{- define "pdserve.workerPools" -}}
{{- if .Values.prefill.enabled }}prefill decode{{ else }}decode{{ end }}
{{- end }}
