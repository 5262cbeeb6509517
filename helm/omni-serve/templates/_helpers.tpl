{{/*
Names and labels (Helm conventions).
*/}}

{{/* Chart name. */}}
{{- define "omni-serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's resources. KubeRay rejects RayService names over 47 characters (it appends a
6-character suffix to name the RayCluster, whose Services get "-serve-svc" and must stay within 63).
*/}}
{{- define "omni-serve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Chart label value. */}}
{{- define "omni-serve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels. */}}
{{- define "omni-serve.labels" -}}
helm.sh/chart: {{ include "omni-serve.chart" . }}
{{ include "omni-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: omni-serve
{{- end }}

{{/* Selector labels (also on every Ray pod). */}}
{{- define "omni-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "omni-serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The Service KubeRay creates in front of the Serve proxies of a RayService. */}}
{{- define "omni-serve.serveServiceName" -}}
{{- printf "%s-serve-svc" (include "omni-serve.fullname" .) }}
{{- end }}

{{/* Image reference. */}}
{{- define "omni-serve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/*
The graphs this chart knows (graphs.yaml, generated from omni_serve's family registry by scripts/render_k8s.py):
the app builder's import path, the checkpoint family of `omni-serve make-checkpoint`, and every stage name the
graph's spec accepts under `stages`.
*/}}
{{- define "omni-serve.graphs" -}}
{{ .Files.Get "graphs.yaml" }}
{{- end }}

{{/* The selected graph's entry of omni-serve.graphs (YAML). */}}
{{- define "omni-serve.graph" -}}
{{- $graphs := include "omni-serve.graphs" . | fromYaml }}
{{- $graph := get $graphs .Values.graph.name }}
{{- if not $graph }}
{{- fail (printf "graph.name %q is not one of: %s" .Values.graph.name (keys $graphs | sortAlpha | join ", ")) }}
{{- end }}
{{- toYaml $graph }}
{{- end }}

{{/* Serve application name. */}}
{{- define "omni-serve.appName" -}}
{{- .Values.graph.appName | default .Values.graph.name }}
{{- end }}

{{/* Checkpoint directory inside the Ray containers (args.checkpoint). */}}
{{- define "omni-serve.checkpointPath" -}}
{{- .Values.checkpoint.mountPath }}
{{- end }}

{{/*
Configuration checks that the values schema cannot express; rendered (empty) by the RayService template.
*/}}
{{- define "omni-serve.validate" -}}
{{- $ck := .Values.checkpoint }}
{{- $sources := list }}
{{- if $ck.existingClaim }}{{ $sources = append $sources "checkpoint.existingClaim" }}{{ end }}
{{- if $ck.hostPath }}{{ $sources = append $sources "checkpoint.hostPath" }}{{ end }}
{{- if $ck.generate.enabled }}{{ $sources = append $sources "checkpoint.generate.enabled" }}{{ end }}
{{- if ne (len $sources) 1 }}
{{- fail (printf "set exactly one checkpoint source (checkpoint.existingClaim, checkpoint.hostPath or checkpoint.generate.enabled; set checkpoint.generate.enabled=false when using a volume), got: [%s]" (join ", " $sources)) }}
{{- end }}
{{- if and $ck.generate.enabled $ck.subPath }}
{{- fail "checkpoint.subPath applies to existingClaim and hostPath, not to a generated checkpoint" }}
{{- end }}
{{- range $key := list "checkpoint" "stages" }}
{{- if hasKey ($.Values.args | default dict) $key }}
{{- fail (printf "args.%s: set it with the chart's `%s` value instead (the chart fills args.%s)" $key $key $key) }}
{{- end }}
{{- end }}
{{- $graph := include "omni-serve.graph" . | fromYaml }}
{{- include "omni-serve.validateCombined" (dict "root" . "graph" $graph) }}
{{- $jobs := .Values.jobs }}
{{- if and (or $jobs.existingClaim $jobs.databaseUrlSecret.name) (not $graph.jobs) }}
{{- fail (printf "jobs: graph %s keeps no jobs (the job volume and database are for graphs with a job API, e.g. wan)" .Values.graph.name) }}
{{- end }}
{{- if and $jobs.databaseUrlSecret.name (not $jobs.existingClaim) }}
{{- fail "jobs.databaseUrlSecret needs jobs.existingClaim: the ingress replicas that share the database must share the results volume too" }}
{{- end }}
{{- if and $jobs.existingClaim (hasKey (dig "jobs" dict (.Values.args | default dict)) "dir") }}
{{- fail "args.jobs.dir: the chart sets it to jobs.mountPath when jobs.existingClaim is set" }}
{{- end }}
{{- range $stage, $_ := .Values.stages }}
{{- if not (has $stage $graph.stages) }}
{{- fail (printf "stages.%s: graph %s has no stage %q (its stages: %s)" $stage $.Values.graph.name $stage (join ", " $graph.stages)) }}
{{- end }}
{{- end }}
{{- $groupNames := list }}
{{- range .Values.workerGroups }}
{{- if has .name $groupNames }}
{{- fail (printf "workerGroups: duplicate group name %q" .name) }}
{{- end }}
{{- $groupNames = append $groupNames .name }}
{{- if gt (int .minReplicas) (int .maxReplicas) }}
{{- fail (printf "workerGroups[%s]: minReplicas %v is above maxReplicas %v" .name .minReplicas .maxReplicas) }}
{{- end }}
{{- $replicas := hasKey . "replicas" | ternary .replicas .minReplicas }}
{{- if or (lt (int $replicas) (int .minReplicas)) (gt (int $replicas) (int .maxReplicas)) }}
{{- fail (printf "workerGroups[%s]: replicas %v is outside [minReplicas %v, maxReplicas %v]" .name $replicas .minReplicas .maxReplicas) }}
{{- end }}
{{- end }}
{{- $autoscalerV2 := and .Values.rayAutoscaler.enabled (eq (toString (dig "version" "" (.Values.rayAutoscaler.options | default dict))) "v2") }}
{{- range .Values.workerGroups }}
{{- if and (hasKey . "idleTimeoutSeconds") (not $autoscalerV2) }}
{{- fail (printf "workerGroups[%s].idleTimeoutSeconds needs the Ray autoscaler v2 (rayAutoscaler.enabled=true, rayAutoscaler.options.version=v2); otherwise use rayAutoscaler.options.idleTimeoutSeconds" .name) }}
{{- end }}
{{- end }}
{{- /* KubeRay rejects Ray resources given both in `resources` and in rayStartParams, and rayStartParams.labels. */}}
{{- $groups := list (dict "label" "head" "group" .Values.head) }}
{{- range .Values.workerGroups }}
{{- $groups = append $groups (dict "label" (printf "workerGroups[%s]" .name) "group" .) }}
{{- end }}
{{- range $groups }}
{{- $label := .label }}
{{- $params := .group.rayStartParams | default dict }}
{{- if hasKey $params "labels" }}
{{- fail (printf "%s.rayStartParams.labels: KubeRay rejects it (Ray node labels go in the group's `labels` field)" $label) }}
{{- end }}
{{- if .group.rayResources }}
{{- range $param := list "num-cpus" "num-gpus" "memory" "resources" }}
{{- if hasKey $params $param }}
{{- fail (printf "%s: Ray resources set both in rayResources and in rayStartParams.%s; KubeRay accepts only one of them" $label $param) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- $_ := include "omni-serve.sharedMemory" (dict "root" . "group" .Values.head "groupName" "head") }}
{{- range .Values.workerGroups }}
{{- $_ := include "omni-serve.sharedMemory" (dict "root" $ "group" . "groupName" (printf "workerGroups[%s]" .name)) }}
{{- end }}
{{- /* Security settings. */}}
{{- $auth := .Values.ray.authOptions | default dict }}
{{- if and (ne (toString $auth.mode) "token") (or $auth.secretName $auth.enableK8sTokenAuth) }}
{{- fail "ray.authOptions: secretName and enableK8sTokenAuth apply to mode: token" }}
{{- end }}
{{- $dashboardHost := toString (dig "dashboard-host" "0.0.0.0" (.Values.head.rayStartParams | default dict)) }}
{{- if has $dashboardHost (list "localhost" "127.0.0.1" "::1") }}
{{- fail (printf "head.rayStartParams.dashboard-host %q: the KubeRay operator deploys the Serve config and reads its status through the dashboard (head Service, port `dashboard`), so it must listen on the pod IP; ray.authOptions (token) and the NetworkPolicy protect it" $dashboardHost) }}
{{- end }}
{{- $reserved := list "gcs-server" "dashboard" "client" "serve" "metrics" }}
{{- range .Values.head.ports }}
{{- if has .name $reserved }}
{{- fail (printf "head.ports: %q is declared by the chart (reserved: %s); head.ports holds extra ports only" .name (join ", " $reserved)) }}
{{- end }}
{{- end }}
{{- if and (not .Values.apiKey.existingSecret) (not .Values.apiKey.allowUnauthenticated) }}
{{- fail "apiKey: no API key is set, so the OpenAI API would be open to every pod and client that reaches the serve Service. Create a Secret (kubectl create secret generic omni-api-key --from-literal=api-key=<key>) and set apiKey.existingSecret=omni-api-key, or set apiKey.allowUnauthenticated=true to serve an open API on purpose" }}
{{- end }}
{{- end }}

{{/*
Ray ports of the head container: gcs-server and dashboard (KubeRay needs both on the head Service), client
with head.rayClient.enabled. Numbers follow head.rayStartParams (port, dashboard-port, ray-client-server-port).
Output: YAML {gcs-server: N, dashboard: N[, client: N]}.
*/}}
{{- define "omni-serve.headRayPorts" -}}
{{- $params := .Values.head.rayStartParams | default dict }}
{{- $ports := dict
      "gcs-server" (int (dig "port" 6379 $params))
      "dashboard" (int (dig "dashboard-port" 8265 $params)) }}
{{- if .Values.head.rayClient.enabled }}
{{- $_ := set $ports "client" (int (dig "ray-client-server-port" 10001 $params)) }}
{{- end }}
{{- toYaml $ports }}
{{- end }}

{{/*
securityContext of a container: containerSecurityContext, the group's securityContext merged over it, and
IPC_LOCK for a group with rdma: true. Args: dict root, group (may be empty: the initContainer).
*/}}
{{- define "omni-serve.containerSecurityContext" -}}
{{- $sc := mergeOverwrite (deepCopy (.root.Values.containerSecurityContext | default dict)) (deepCopy (.group.securityContext | default dict)) }}
{{- if .group.rdma }}
{{- /* Mooncake's RDMA memory registration pins its registered buffer (mlock). */}}
{{- $caps := $sc.capabilities | default dict }}
{{- $add := $caps.add | default list }}
{{- if not (has "IPC_LOCK" $add) }}
{{- $add = append $add "IPC_LOCK" }}
{{- end }}
{{- $_ := set $caps "add" $add }}
{{- $_ := set $sc "capabilities" $caps }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/*
Effective shared-memory settings of a group (global `sharedMemory` overridden by the group's), checked for
consistency. Args: dict root, group, groupName. Output: YAML {sizeMiB, objectStoreMiB, poolMiB}.
*/}}
{{- define "omni-serve.sharedMemory" -}}
{{- $shm := mergeOverwrite (deepCopy .root.Values.sharedMemory) (deepCopy (.group.sharedMemory | default dict)) }}
{{- if gt (add (int $shm.objectStoreMiB) (int $shm.poolMiB)) (int $shm.sizeMiB) }}
{{- fail (printf "%s sharedMemory: objectStoreMiB (%v) + poolMiB (%v) exceed sizeMiB (%v): the Ray object store and the shm connector's pool both live in /dev/shm" .groupName $shm.objectStoreMiB $shm.poolMiB $shm.sizeMiB) }}
{{- end }}
{{- toYaml $shm }}
{{- end }}

{{/*
Graph args (Serve config `args`): `args`, plus the checkpoint path and `stages`.
*/}}
{{- define "omni-serve.appArgs" -}}
{{- $args := deepCopy (.Values.args | default dict) }}
{{- if eq .Values.graph.name "combined" }}
{{- $graphs := dict }}
{{- range $name, $entry := .Values.combined.graphs }}
{{- $one := deepCopy ($entry.args | default dict) }}
{{- $_ := set $one "checkpoint" (printf "%s/%s" (include "omni-serve.checkpointPath" $) $name) }}
{{- if $entry.stages }}
{{- $_ := set $one "stages" (deepCopy $entry.stages) }}
{{- end }}
{{- $_ := set $graphs $name $one }}
{{- end }}
{{- $_ := set $args "graphs" $graphs }}
{{- toYaml $args }}
{{- else }}
{{- $_ := set $args "checkpoint" (include "omni-serve.checkpointPath" .) }}
{{- if .Values.jobs.existingClaim }}
{{- $_ := set $args "jobs" (merge (dict "dir" .Values.jobs.mountPath) (deepCopy (dig "jobs" dict $args))) }}
{{- end }}
{{- if .Values.stages }}
{{- $_ := set $args "stages" (deepCopy .Values.stages) }}
{{- end }}
{{- toYaml $args }}
{{- end }}
{{- end }}

{{/*
Checks of a combined app (graph.name combined: several graphs behind one ingress). Args: dict root, graph (the
selected graphs.yaml entry).
*/}}
{{- define "omni-serve.validateCombined" -}}
{{- $v := .root.Values }}
{{- $graphs := include "omni-serve.graphs" .root | fromYaml }}
{{- if .graph.combined }}
{{- if not $v.combined.graphs }}
{{- fail "graph.name combined: list the graphs to serve together in combined.graphs" }}
{{- end }}
{{- if or $v.stages $v.serveConfig $v.autoscalingPolicy.enabled $v.jobs.existingClaim $v.jobs.databaseUrlSecret.name }}
{{- fail "graph.name combined: set each graph's stages in combined.graphs.<graph>.stages; serveConfig, autoscalingPolicy and jobs do not apply" }}
{{- end }}
{{- range $key, $_ := $v.args | default dict }}
{{- if not (has $key (list "ingress" "data_plane" "logging")) }}
{{- fail (printf "args.%s: with graph.name combined, args holds what the graphs share (ingress, data_plane, logging); set a graph's own values in combined.graphs.<graph>.args" $key) }}
{{- end }}
{{- end }}
{{- range $name, $entry := $v.combined.graphs }}
{{- $one := get $graphs $name }}
{{- if or (not $one) $one.combined }}
{{- fail (printf "combined.graphs.%s: not a graph of the registry" $name) }}
{{- end }}
{{- if and $v.checkpoint.generate.enabled (not $one.checkpointFamily) }}
{{- fail (printf "combined.graphs.%s has no checkpoint writer: set checkpoint.generate.enabled=false" $name) }}
{{- end }}
{{- range $key := list "checkpoint" "stages" "ingress" "data_plane" "logging" }}
{{- if hasKey ($entry.args | default dict) $key }}
{{- fail (printf "combined.graphs.%s.args.%s: the chart sets the checkpoint, stages go in combined.graphs.%s.stages, and ingress, data_plane and logging are shared (args)" $name $key $name) }}
{{- end }}
{{- end }}
{{- range $stage, $_ := $entry.stages | default dict }}
{{- if not (has $stage $one.stages) }}
{{- fail (printf "combined.graphs.%s.stages.%s: graph %s has no stage %q (its stages: %s)" $name $stage $name $stage (join ", " $one.stages)) }}
{{- end }}
{{- end }}
{{- end }}
{{- else if $v.combined.graphs }}
{{- fail "combined.graphs applies to graph.name combined" }}
{{- end }}
{{- end }}

{{/*
Ray Serve config (ServeDeploySchema) of the RayService's serveConfigV2, as YAML.
*/}}
{{- define "omni-serve.serveConfig" -}}
{{- if .Values.serveConfig }}
{{- /* A config written by `omni-serve build`: deployed as written (each stage's settings in its own deployment
       entry), with the chart's proxy location and HTTP options. */}}
{{- $config := include "omni-serve.builtServeConfig" . | fromYaml }}
{{- $_ := set $config "proxy_location" .Values.serve.proxyLocation }}
{{- $_ := set $config "http_options" (dict "host" "0.0.0.0" "port" .Values.serve.port) }}
{{- toYaml $config }}
{{- else }}
{{- include "omni-serve.valuesServeConfig" . }}
{{- end }}
{{- end }}

{{/*
The `serveConfig` value (a Serve config written by `omni-serve build`), parsed and checked against the chart's
graph and checkpoint. Output: the config as YAML.
*/}}
{{- define "omni-serve.builtServeConfig" -}}
{{- $config := .Values.serveConfig | fromYaml }}
{{- if or (hasKey $config "Error") (not (kindIs "slice" $config.applications)) }}
{{- fail "serveConfig: not a Serve config with `applications` (write one with omni-serve build ... -o serve_config.yaml and pass it with --set-file serveConfig=serve_config.yaml)" }}
{{- end }}
{{- if or .Values.args .Values.stages .Values.autoscalingPolicy.enabled }}
{{- fail "serveConfig: args, stages and autoscalingPolicy come from the built config; leave them empty here" }}
{{- end }}
{{- $graph := include "omni-serve.graph" . | fromYaml }}
{{- $checkpoint := include "omni-serve.checkpointPath" . }}
{{- range $config.applications }}
{{- if ne .import_path $graph.importPath }}
{{- fail (printf "serveConfig: application %s serves %s, but graph.name %s is %s (the checkpoint volume and its generator follow graph.name)" .name .import_path $.Values.graph.name $graph.importPath) }}
{{- end }}
{{- if ne (toString .route_prefix) (toString $.Values.graph.routePrefix) }}
{{- fail (printf "serveConfig: application %s has route_prefix %v, but graph.routePrefix is %s (build with --route-prefix %s, or set graph.routePrefix)" .name .route_prefix $.Values.graph.routePrefix $.Values.graph.routePrefix) }}
{{- end }}
{{- if and $.Values.graph.appName (ne (toString .name) (toString $.Values.graph.appName)) }}
{{- fail (printf "serveConfig: the application is named %s, but graph.appName is %s (build with --name %s, or leave graph.appName empty)" .name $.Values.graph.appName $.Values.graph.appName) }}
{{- end }}
{{- if ne (toString (dig "checkpoint" "" (.args | default dict))) $checkpoint }}
{{- fail (printf "serveConfig: application %s has checkpoint %v, but the pods see it at %s (build with checkpoint=%s)" .name (dig "checkpoint" "" (.args | default dict)) $checkpoint $checkpoint) }}
{{- end }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/*
The Serve config rendered from the chart's values: one application, `args` from `args` + the checkpoint path +
`stages` (a change to any of them redeploys the whole graph).
*/}}
{{- define "omni-serve.valuesServeConfig" -}}
{{- $graph := include "omni-serve.graph" . | fromYaml }}
{{- $app := dict
      "name" (include "omni-serve.appName" .)
      "route_prefix" .Values.graph.routePrefix
      "import_path" $graph.importPath
      "args" (include "omni-serve.appArgs" . | fromYaml) }}
{{- if .Values.autoscalingPolicy.enabled }}
{{- $_ := set $app "autoscaling_policy" (dict
      "policy_function" .Values.autoscalingPolicy.policyFunction
      "policy_kwargs" (deepCopy (.Values.autoscalingPolicy.policyKwargs | default dict))) }}
{{- end }}
{{- /* Proxies listen on every interface of the pod: the Service reaches them through the pod IP. */}}
{{- $config := dict
      "proxy_location" .Values.serve.proxyLocation
      "http_options" (dict "host" "0.0.0.0" "port" .Values.serve.port)
      "applications" (list $app) }}
{{- toYaml $config }}
{{- end }}

{{/*
rayStartParams of a group: metrics port, object store size (from its shared memory), the group's own.
Args: dict root, group, groupName, head (bool).
*/}}
{{- define "omni-serve.rayStartParams" -}}
{{- $shm := include "omni-serve.sharedMemory" . | fromYaml }}
{{- $params := dict
      "metrics-export-port" (toString .root.Values.metrics.port)
      "object-store-memory" (toString (mul (int $shm.objectStoreMiB) 1048576)) }}
{{- if .head }}
{{- /* On the pod IP: KubeRay reaches the dashboard through the head Service to deploy the Serve config
     (authenticated by the Ray token; the NetworkPolicy admits only the operator and the release's pods). */}}
{{- $_ := set $params "dashboard-host" "0.0.0.0" }}
{{- end }}
{{- range $key, $value := (.group.rayStartParams | default dict) }}
{{- $_ := set $params $key (toString $value) }}
{{- end }}
{{- toYaml $params }}
{{- end }}

{{/* KubeRay group `resources` (Ray logical resources): quantities as strings. Args: group. */}}
{{- define "omni-serve.rayResources" -}}
{{- $out := dict }}
{{- range $key, $value := (.rayResources | default dict) }}
{{- $_ := set $out $key (toString $value) }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/*
Pod template of a Ray group (head or worker). Args: dict root, group, groupName, head (bool).
*/}}
{{- define "omni-serve.podTemplate" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $group := .group }}
{{- $shm := include "omni-serve.sharedMemory" . | fromYaml }}
{{- $graph := include "omni-serve.graph" $root | fromYaml -}}
metadata:
  labels:
    {{- include "omni-serve.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ ternary "ray-head" "ray-worker" .head }}
    {{- with $group.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $group.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $v.image.pullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.serviceAccountName }}
  serviceAccountName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ add (int $v.drain.timeoutSeconds) (int $v.drain.marginSeconds) }}
  {{- with $v.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $v.checkpoint.generate.enabled }}
  {{- /* one checkpoint, or one per graph of a combined app (in a directory of its name) */}}
  {{- $writes := list }}
  {{- if $graph.combined }}
  {{- range $name, $_ := $v.combined.graphs }}
  {{- $writes = append $writes (dict "family" $name "path" (printf "%s/%s" (include "omni-serve.checkpointPath" $root) $name) "container" (printf "make-checkpoint-%s" ($name | replace "_" "-"))) }}
  {{- end }}
  {{- else }}
  {{- $writes = list (dict "family" (required (printf "graph %s has no checkpoint writer: set checkpoint.generate.enabled=false" $root.Values.graph.name) $graph.checkpointFamily) "path" (include "omni-serve.checkpointPath" $root) "container" "make-checkpoint") }}
  {{- end }}
  initContainers:
    {{- range $writes }}
    - name: {{ .container }}
      image: {{ include "omni-serve.image" $root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command:
        - omni-serve
        - make-checkpoint
        - {{ .family }}
        - --size
        - {{ $v.checkpoint.generate.size }}
        - --seed
        - {{ $v.checkpoint.generate.seed | quote }}
        - {{ .path }}
      {{- with $v.checkpoint.generate.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with include "omni-serve.containerSecurityContext" (dict "root" $root "group" dict) | fromYaml }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: checkpoint
          mountPath: {{ include "omni-serve.checkpointPath" $root }}
    {{- end }}
  {{- end }}
  containers:
    # KubeRay runs Ray in the first container.
    - name: {{ ternary "ray-head" "ray-worker" .head }}
      image: {{ include "omni-serve.image" $root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      ports:
        {{- if .head }}
        {{- range $name, $port := include "omni-serve.headRayPorts" $root | fromYaml }}
        - name: {{ $name }}
          containerPort: {{ $port }}
        {{- end }}
        {{- with $group.ports }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- end }}
        - name: serve
          containerPort: {{ $v.serve.port }}
        - name: metrics
          containerPort: {{ $v.metrics.port }}
      env:
        - name: OMNI_SERVE_SHM_DIR
          value: /dev/shm
        - name: OMNI_SERVE_SHM_POOL_BYTES
          value: {{ mul (int $shm.poolMiB) 1048576 | quote }}
        - name: OMNI_SERVE_DATA_TTL_S
          value: {{ $v.dataPlane.dataTtlSeconds | toString | quote }}
        - name: OMNI_SERVE_RAY_NAMESPACE
          value: {{ $v.dataPlane.rayNamespace | quote }}
        {{- if .head }}
        {{- with $v.head.nodeHealthCheck }}
        - name: RAY_health_check_period_ms
          value: {{ .periodMs | toString | quote }}
        - name: RAY_health_check_timeout_ms
          value: {{ .timeoutMs | toString | quote }}
        - name: RAY_health_check_failure_threshold
          value: {{ .failureThreshold | toString | quote }}
        {{- end }}
        {{- end }}
        {{- with $v.dataPlane.autoConnector }}
        - name: OMNI_SERVE_AUTO_CONNECTOR
          value: {{ . | quote }}
        {{- end }}
        {{- with $v.jobs.databaseUrlSecret.name }}
        - name: OMNI_SERVE_JOBS_URL
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $v.jobs.databaseUrlSecret.key }}
        {{- end }}
        {{- with $v.apiKey.existingSecret }}
        - name: OMNI_SERVE_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $v.apiKey.secretKey }}
        {{- end }}
        {{- with $v.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $group.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $group.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with include "omni-serve.containerSecurityContext" (dict "root" $root "group" $group) | fromYaml }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      lifecycle:
        preStop:
          exec:
            {{- /* Serve moves this pod's replicas elsewhere and their requests finish before Ray stops
                   (omni-serve drain-node returns at once on the head). */}}
            command: ["/bin/sh", "-c", {{ printf "omni-serve drain-node --deadline-s %d; ray stop" (int $v.drain.timeoutSeconds) | quote }}]
      volumeMounts:
        - name: shm
          mountPath: /dev/shm
        - name: checkpoint
          mountPath: {{ include "omni-serve.checkpointPath" $root }}
          {{- if and (not $v.checkpoint.generate.enabled) $v.checkpoint.subPath }}
          subPath: {{ $v.checkpoint.subPath }}
          {{- end }}
          {{- if not $v.checkpoint.generate.enabled }}
          readOnly: {{ $v.checkpoint.readOnly }}
          {{- end }}
        {{- if $v.jobs.existingClaim }}
        - name: jobs
          mountPath: {{ $v.jobs.mountPath }}
          {{- with $v.jobs.subPath }}
          subPath: {{ . }}
          {{- end }}
        {{- end }}
  volumes:
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ printf "%dMi" (int $shm.sizeMiB) }}
    - name: checkpoint
      {{- if $v.checkpoint.existingClaim }}
      persistentVolumeClaim:
        claimName: {{ $v.checkpoint.existingClaim }}
        readOnly: {{ $v.checkpoint.readOnly }}
      {{- else if $v.checkpoint.hostPath }}
      hostPath:
        path: {{ $v.checkpoint.hostPath }}
        type: {{ $v.checkpoint.hostPathType }}
      {{- else }}
      emptyDir:
        sizeLimit: {{ $v.checkpoint.generate.sizeLimit }}
      {{- end }}
    {{- with $v.jobs.existingClaim }}
    - name: jobs
      persistentVolumeClaim:
        claimName: {{ . }}
    {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
