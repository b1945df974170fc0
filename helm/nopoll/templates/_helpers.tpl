{{/*
Expand the name of the chart.
*/}}
{{- define "nopoll.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name.
We truncate at 63 chars because some Kubernetes name fields are limited to this (by the DNS naming spec).
If release name contains chart name it will be used as a full name.
*/}}
{{- define "nopoll.fullname" -}}
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

{{/*
The name of one component's objects: the fullname cut so that "-<component>" still fits in
63 characters (52 for StatefulSets, whose pods get a revision-hash label), so components
never collide after truncation. Call with (dict "ctx" $ "component" "api" "max" 63).
*/}}
{{- define "nopoll.componentName" -}}
{{- $max := .max | default 63 | int }}
{{- $keep := sub (sub $max (len .component)) 1 | int }}
{{- printf "%s-%s" (include "nopoll.fullname" .ctx | trunc $keep | trimSuffix "-") .component }}
{{- end }}

{{/*
Create chart name and version as used by the chart label.
*/}}
{{- define "nopoll.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels
*/}}
{{- define "nopoll.labels" -}}
helm.sh/chart: {{ include "nopoll.chart" . }}
{{ include "nopoll.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Selector labels
*/}}
{{- define "nopoll.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nopoll.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Labels and selector labels of one component. Call with (dict "ctx" $ "component" "api").
*/}}
{{- define "nopoll.componentLabels" -}}
{{ include "nopoll.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "nopoll.componentSelectorLabels" -}}
{{ include "nopoll.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Create the name of the service account to use
*/}}
{{- define "nopoll.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "nopoll.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The nopoll image reference: repository@digest, else repository:tag (tag defaults to appVersion).
*/}}
{{- define "nopoll.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{- define "nopoll.configPath" -}}
/etc/nopoll/nopoll.yaml
{{- end }}

{{- define "nopoll.apiServiceName" -}}
{{- include "nopoll.componentName" (dict "ctx" . "component" "api") }}
{{- end }}

{{- define "nopoll.redisName" -}}
{{- include "nopoll.componentName" (dict "ctx" . "component" "redis" "max" 52) }}
{{- end }}

{{/*
The nopoll config file: the user's config plus what the chart owns (redis_url, data_dir).
*/}}
{{- define "nopoll.configFile" -}}
# Rendered by the nopoll Helm chart (docs/configuration.md). Secrets are ${VAR} references
# to environment variables from the release's Secret; they are never written here.
redis_url: ${REDIS_URL}
data_dir: /data
{{- $config := deepCopy .Values.config }}
{{- with .Values.ingress.trustedProxies }}
{{- $api := deepCopy ($config.api | default dict) }}
{{- $_ := set $api "trusted_proxies" . }}
{{- $_ = set $config "api" $api }}
{{- end }}
{{ toYaml $config }}
{{- end }}

{{/*
What the chart's own Secret holds, as YAML (env var name -> value). Empty when
existingSecret is used.
*/}}
{{- define "nopoll.secretData" -}}
{{- if not .Values.existingSecret }}
{{- $data := deepCopy (.Values.secret.env | default dict) }}
{{- if .Values.redis.url }}
{{- $_ := set $data "REDIS_URL" .Values.redis.url }}
{{- end }}
{{- if and .Values.redis.bundled.enabled .Values.redis.bundled.auth.enabled }}
{{- $_ := set $data "REDIS_PASSWORD" .Values.redis.bundled.auth.password }}
{{- end }}
{{- if $data }}
{{- toYaml $data }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The Secret the pods read their environment from ("" when there is none).
*/}}
{{- define "nopoll.secretName" -}}
{{- if .Values.existingSecret }}
{{- .Values.existingSecret }}
{{- else if include "nopoll.secretData" . }}
{{- include "nopoll.fullname" . }}
{{- end }}
{{- end }}

{{/*
Pod annotations that roll the pods when the config or the chart's Secret changes.
*/}}
{{- define "nopoll.checksums" -}}
checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secret: {{ include (print $.Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end }}

{{/*
Environment of every nopoll container (api, worker, init, test).
*/}}
{{- define "nopoll.env" -}}
{{- $secretName := include "nopoll.secretName" . }}
{{- if $secretName }}
envFrom:
  - secretRef:
      name: {{ $secretName }}
  {{- with .Values.extraEnvFrom }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- else if .Values.extraEnvFrom }}
envFrom:
  {{- toYaml .Values.extraEnvFrom | nindent 2 }}
{{- end }}
env:
  - name: NOPOLL_CONFIG
    value: {{ include "nopoll.configPath" . }}
  {{- if .Values.redis.bundled.enabled }}
  {{- $host := printf "%s.%s.svc" (include "nopoll.redisName" .) .Release.Namespace }}
  {{- if .Values.redis.bundled.auth.enabled }}
  - name: REDIS_PASSWORD
    valueFrom:
      secretKeyRef:
        name: {{ $secretName }}
        key: REDIS_PASSWORD
  - name: REDIS_URL
    value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" $host | quote }}
  {{- else }}
  - name: REDIS_URL
    value: {{ printf "redis://%s:6379/0" $host | quote }}
  {{- end }}
  {{- else if .Values.redis.existingSecretKey }}
  - name: REDIS_URL
    valueFrom:
      secretKeyRef:
        name: {{ .Values.existingSecret }}
        key: {{ .Values.redis.existingSecretKey }}
  {{- else }}
  - name: REDIS_URL
    valueFrom:
      secretKeyRef:
        name: {{ $secretName }}
        key: REDIS_URL
  {{- end }}
  {{- with .Values.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/*
Volumes and mounts of every nopoll pod: the config (read-only), /data and /tmp.
*/}}
{{- define "nopoll.volumes" -}}
- name: config
  configMap:
    name: {{ include "nopoll.fullname" . }}
- name: data
  {{- if .Values.dataVolume }}
  {{- toYaml .Values.dataVolume | nindent 2 }}
  {{- else }}
  emptyDir: {}
  {{- end }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}

{{- define "nopoll.volumeMounts" -}}
- name: config
  mountPath: /etc/nopoll
  readOnly: true
- name: data
  mountPath: /data
- name: tmp
  mountPath: /tmp
{{- end }}

{{/*
The init container that validates the config with the pod's own environment.
*/}}
{{- define "nopoll.configCheckContainer" -}}
- name: config-check
  image: {{ include "nopoll.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["nopoll", "config", "check", "--config", {{ include "nopoll.configPath" . | quote }}]
  {{- include "nopoll.env" . | trim | nindent 2 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml .Values.configCheck.resources | nindent 4 }}
  volumeMounts:
    {{- include "nopoll.volumeMounts" . | nindent 4 }}
{{- end }}

{{/*
Pod-level settings shared by the api and worker pods. Call with (dict "ctx" $ "role" .Values.api).
*/}}
{{- define "nopoll.podPlacement" -}}
{{- with .role.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .role.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .role.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .role.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .role.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "nopoll.podCommon" -}}
serviceAccountName: {{ include "nopoll.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/*
Every check that must hold before anything is rendered. Included once, by configmap.yaml.
*/}}
{{- define "nopoll.validate" -}}
{{- $v := .Values }}
{{- $ref := `^\$\{[A-Za-z_][A-Za-z0-9_]*(:-)?\}$` }}

{{- if and $v.ingress.trustedProxies $v.config.api $v.config.api.trusted_proxies }}
{{- fail "config.api.trusted_proxies: set ingress.trustedProxies instead (the chart writes it there); not both" }}
{{- end }}

{{- /* Redis: exactly one shared server. */}}
{{- $sources := 0 }}
{{- if $v.redis.url }}{{ $sources = add1 $sources }}{{ end }}
{{- if $v.redis.existingSecretKey }}{{ $sources = add1 $sources }}{{ end }}
{{- if $v.redis.bundled.enabled }}{{ $sources = add1 $sources }}{{ end }}
{{- if eq $sources 0 }}
{{- fail "redis: nopoll needs one Redis shared by all its pods. Set redis.url (an external Redis; kept in the chart's Secret), redis.existingSecretKey (the key of existingSecret holding the URL) or redis.bundled.enabled=true. The embedded server of `nopoll serve` is for a single process and cannot be shared between pods." }}
{{- end }}
{{- if gt $sources 1 }}
{{- fail "redis: set only one of redis.url, redis.existingSecretKey and redis.bundled.enabled" }}
{{- end }}
{{- if and $v.redis.url $v.existingSecret }}
{{- fail "redis.url: with existingSecret the chart creates no Secret; put the URL in your Secret and set redis.existingSecretKey to its key" }}
{{- end }}
{{- if and $v.redis.existingSecretKey (not $v.existingSecret) }}
{{- fail "redis.existingSecretKey: names a key of existingSecret, which is not set" }}
{{- end }}
{{- if and $v.existingSecret $v.secret.env }}
{{- fail "secret.env: with existingSecret the chart creates no Secret; put these variables in your Secret" }}
{{- end }}
{{- if and $v.redis.bundled.enabled $v.redis.bundled.auth.enabled (not $v.existingSecret) }}
{{- $pw := required "redis.bundled.auth.password is required with the bundled Redis (or set redis.bundled.auth.enabled=false, or existingSecret holding REDIS_PASSWORD)" $v.redis.bundled.auth.password }}
{{- if not (regexMatch `^[A-Za-z0-9._~-]+$` $pw) }}
{{- fail "redis.bundled.auth.password: use URL-safe characters only ([A-Za-z0-9._~-]); it goes into the Redis URL" }}
{{- end }}
{{- end }}

{{- /* Config: results need a sink that outlives the pod; secrets are ${VAR} references. */}}
{{- if not $v.config.sinks }}
{{- fail "config.sinks: configure at least one sink (e.g. {warehouse: {type: sql, url: \"${DATABASE_URL}\"}}). Without one nopoll writes SQLite and JSONL files under each pod's /data, which are split across worker replicas and lost with the pods." }}
{{- end }}
{{- range $name, $p := $v.config.providers }}
{{- if and $p.api_key (not (regexMatch $ref (toString $p.api_key))) }}
{{- fail (printf "config.providers.%s.api_key: write a ${VAR} reference and put the key in secret.env (or existingSecret), never the key itself" $name) }}
{{- end }}
{{- range $i, $s := $p.webhook_secrets }}
{{- if not (regexMatch $ref (toString $s)) }}
{{- fail (printf "config.providers.%s.webhook_secrets.%d: write a ${VAR} reference and put the secret in secret.env (or existingSecret), never the secret itself" $name $i) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $name, $sink := $v.config.sinks }}
{{- range $key, $val := $sink }}
{{- if kindIs "string" $val }}
{{- if and (regexMatch `(?i)(secret|password|passwd|token|api_?key|access_?key|credential)` $key) $val (not (regexMatch $ref $val)) }}
{{- fail (printf "config.sinks.%s.%s: write a ${VAR} reference and put the value in secret.env (or existingSecret)" $name $key) }}
{{- end }}
{{- if and (regexMatch `^[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*:[^/@\s]+@` $val) (not (contains "${" $val)) }}
{{- fail (printf "config.sinks.%s.%s: this URL holds a password; write ${VAR} and put the URL in secret.env (or existingSecret)" $name $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- /* Every ${VAR} without a default must be provided by the chart's Secret or extraEnv. */}}
{{- if and (not $v.existingSecret) (not $v.extraEnvFrom) }}
{{- $provided := dict "REDIS_URL" true }}
{{- range $k, $_ := ($v.secret.env | default dict) }}{{ $_ := set $provided $k true }}{{ end }}
{{- range $v.extraEnv }}{{ $_ := set $provided .name true }}{{ end }}
{{- range $m := regexFindAll `\$\{[A-Za-z_][A-Za-z0-9_]*\}` (toYaml $v.config) -1 }}
{{- $var := trimSuffix "}" (trimPrefix "${" $m) }}
{{- if not (hasKey $provided $var) }}
{{- fail (printf "config references ${%s}, which nothing provides: add %s to secret.env (or extraEnv, or use existingSecret)" $var $var) }}
{{- end }}
{{- end }}
{{- end }}

{{- /* Workloads. */}}
{{- $shutdownWait := 20 }}
{{- if and $v.config.worker (hasKey $v.config.worker "shutdown_wait_s") }}
{{- $shutdownWait = $v.config.worker.shutdown_wait_s }}
{{- end }}
{{- if le (float64 $v.worker.terminationGracePeriodSeconds) (addf $shutdownWait 5) }}
{{- fail (printf "worker.terminationGracePeriodSeconds (%v) must exceed config.worker.shutdown_wait_s (%v) by more than 5 s, or Kubernetes kills running jobs before they can finish" $v.worker.terminationGracePeriodSeconds $shutdownWait) }}
{{- end }}
{{- if and $v.api.autoscaling.enabled (not (dig "requests" "cpu" "" $v.api.resources)) }}
{{- fail "api.autoscaling: a CPU-based HorizontalPodAutoscaler needs api.resources.requests.cpu" }}
{{- end }}
{{- if and $v.worker.autoscaling.enabled (eq $v.worker.autoscaling.type "hpa") (not (dig "requests" "cpu" "" $v.worker.resources)) }}
{{- fail "worker.autoscaling: a CPU-based HorizontalPodAutoscaler needs worker.resources.requests.cpu" }}
{{- end }}
{{- if and $v.worker.autoscaling.enabled (eq $v.worker.autoscaling.type "keda") (eq $v.worker.autoscaling.keda.trigger "prometheus") (not $v.worker.autoscaling.keda.prometheus.serverAddress) }}
{{- fail "worker.autoscaling.keda.prometheus.serverAddress is required with the prometheus trigger" }}
{{- end }}
{{- if and $v.ingress.enabled (not $v.ingress.hosts) }}
{{- fail "ingress.hosts: give at least one host when the ingress is enabled" }}
{{- end }}
{{- end }}

{{/*
The public base URL for the install notes.
*/}}
{{- define "nopoll.publicUrl" -}}
{{- if .Values.publicUrl }}
{{- .Values.publicUrl | trimSuffix "/" }}
{{- else if and .Values.ingress.enabled .Values.ingress.hosts }}
{{- $host := (first .Values.ingress.hosts).host }}
{{- $tls := false }}
{{- range .Values.ingress.tls }}{{ if has $host .hosts }}{{ $tls = true }}{{ end }}{{ end }}
{{- printf "%s://%s" (ternary "https" "http" $tls) $host }}
{{- end }}
{{- end }}

{{/*
A role's values as YAML: the api's own, or the consumers' laid over a copy of the api's
(consumers take every api setting they do not set; they never autoscale).
*/}}
{{- define "nopoll.roleValues" -}}
{{- if eq .role "consumers" }}
{{- $merged := mergeOverwrite (deepCopy .ctx.Values.api) (omit .ctx.Values.consumers "enabled") }}
{{- $_ := set $merged "autoscaling" (dict "enabled" false) }}
{{- toYaml $merged }}
{{- else }}
{{- toYaml (index .ctx.Values .role) }}
{{- end }}
{{- end }}

{{/*
The API Deployments this release runs, as a JSON list: "api", and "consumers" when
consumers.enabled (one home for that condition: Deployments, Services, disruption budgets).
*/}}
{{- define "nopoll.apiRoles" -}}
{{- ternary (list "api" "consumers") (list "api") .Values.consumers.enabled | toJson }}
{{- end }}
