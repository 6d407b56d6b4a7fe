{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "prepos.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Object name prefix: <release>-<chart>, or the release name when it already holds the chart name; at most
45 characters, so that "<prefix>-triton" (52) leaves room for the StatefulSet's controller-revision-hash label
(63 in all; a longer StatefulSet name gets no pods) and every suffixed name stays distinct. */}}
{{- define "prepos.fullname" -}}
{{- $fullname := "" }}
{{- if .Values.fullnameOverride }}
{{- $fullname = .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- $fullname = .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $fullname = printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- /* Helm takes release names with dots, which Service names (DNS-1035 labels) refuse. */}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $fullname) }}
{{- fail (printf "the object name prefix %q (from the release name %q, or fullnameOverride) must be lowercase letters, digits and '-', starting with a letter: Kubernetes refuses such Service names; pick another release name or set fullnameOverride" $fullname .Release.Name) }}
{{- end }}
{{- $fullname }}
{{- end }}

{{/* Names of the objects, shared by the templates that refer to each other. */}}
{{- define "prepos.triton.fullname" -}}
{{- printf "%s-triton" (include "prepos.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- define "prepos.metrics.fullname" -}}
{{- printf "%s-metrics" (include "prepos.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- define "prepos.router.fullname" -}}
{{- printf "%s-router" (include "prepos.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified DNS name of the headless Service; replica i is <triton fullname>-i.<this name>. */}}
{{- define "prepos.triton.dnsName" -}}
{{- printf "%s.%s.svc.%s" (include "prepos.triton.fullname" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "prepos.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{ include "prepos.podLabels" . }}
{{- end }}

{{/* Labels of the pods a StatefulSet or Deployment makes, after the component, and of every object with
prepos.labels: the chart's version and the app's are left out of the pods', so that a new chart version alone does
not roll every replica (draining it) and the router. */}}
{{- define "prepos.podLabels" -}}
app.kubernetes.io/name: {{ include "prepos.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of the Triton replicas. */}}
{{- define "prepos.triton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prepos.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: triton
{{- end }}

{{/* Selector labels of the Envoy router. */}}
{{- define "prepos.router.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prepos.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}

{{/* Triton image reference; image.repository has no default. */}}
{{- define "prepos.image" -}}
{{- $repository := required "image.repository is required: the prepos Triton image built from docker/Dockerfile" .Values.image.repository }}
{{- /* A colon after the last "/" starts a tag (one before it is a registry's port, as in reg:5000/prepos). */}}
{{- if regexMatch ":[^/]*$" $repository }}
{{- fail (printf "image.repository (%s) holds a tag: the chart appends image.tag (default: the chart's appVersion) itself, which would give %s:%s; set the repository alone and the tag in image.tag (or pin with image.digest)" $repository $repository (default .Chart.AppVersion .Values.image.tag)) }}
{{- end }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" $repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* A prepos.env value as the text prepos reads: Helm reads a whole number in a values file as a float, which
would print as 8.589934592e+09 (refused where prepos expects an integer). */}}
{{- define "prepos.envValue" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) (lt . 1e15) (gt . -1e15) -}}
{{- int64 . -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end }}

{{/* Pod anti-affinity by preset, over one host each: (list MODE SELECTOR-LABELS), MODE soft (preferred) or hard
(required); empty for "". */}}
{{- define "prepos.antiAffinity" -}}
{{- $mode := index . 0 }}
{{- $labels := index . 1 }}
{{- if eq $mode "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- $labels | nindent 10 }}
{{- else if eq $mode "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- $labels | nindent 12 }}
{{- end }}
{{- end }}

{{/* A pod's affinity: (list AFFINITY PRESET SELECTOR-LABELS), the affinity written out with the anti-affinity preset
added unless it has a podAntiAffinity of its own (a nodeAffinity written out keeps the preset's spread); empty
when there is neither. */}}
{{- define "prepos.affinity" -}}
{{- $affinity := deepCopy (index . 0 | default dict) }}
{{- if and (index . 1) (not (hasKey $affinity "podAntiAffinity")) }}
{{- $_ := set $affinity "podAntiAffinity" (include "prepos.antiAffinity" (list (index . 1) (index . 2)) | fromYaml).podAntiAffinity }}
{{- end }}
{{- with $affinity }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/* Environment variable that carries the access token into Triton's arguments. */}}
{{- define "prepos.auth.envName" -}}
TRITON_ACCESS_TOKEN
{{- end }}

{{/* A Prometheus duration (the schema's pattern: units in order, e.g. 1m30s) in milliseconds. */}}
{{- define "prepos.durationMs" -}}
{{- $rest := . -}}
{{- $total := 0 -}}
{{- $ms := regexFind "[0-9]+ms$" $rest -}}
{{- if $ms -}}
{{- $total = add $total (trimSuffix "ms" $ms) -}}
{{- $rest = trimSuffix $ms $rest -}}
{{- end -}}
{{- range $unit, $factor := dict "y" 31536000000 "w" 604800000 "d" 86400000 "h" 3600000 "m" 60000 "s" 1000 -}}
{{- $part := regexFind (printf "[0-9]+%s" $unit) $rest -}}
{{- if $part -}}
{{- $total = add $total (mul (trimSuffix $unit $part) $factor) -}}
{{- end -}}
{{- end -}}
{{- $total -}}
{{- end -}}

{{/* A Kubernetes quantity (the schema's pattern: 500m, 4, 1.5, 16Gi, 1e9, or a number) as a plain number. */}}
{{- define "prepos.quantity" -}}
{{- $text := toString . -}}
{{- $factors := dict "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18
  "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 -}}
{{- $suffix := regexFind "[a-zA-Z]+$" $text -}}
{{- if hasKey $factors $suffix -}}
{{- mulf (float64 (trimSuffix $suffix $text)) (get $factors $suffix) -}}
{{- else -}}
{{- float64 $text -}}
{{- end -}}
{{- end -}}

{{/* Fails where a container's request passes its limit, which the API server refuses (the whole StatefulSet or
Deployment): (list PATH RESOURCES), PATH the values' path of RESOURCES, e.g. "resources". A user's requests merge
with the chart's default limits, so that a larger request alone is such a case. */}}
{{- define "prepos.checkRequests" -}}
{{- $path := index . 0 }}
{{- $resources := index . 1 }}
{{- range $name := list "cpu" "memory" "ephemeral-storage" }}
{{- $request := dig "requests" $name nil $resources }}
{{- $limit := dig "limits" $name nil $resources }}
{{- if and (not (kindIs "invalid" $request)) (not (kindIs "invalid" $limit)) }}
{{- if gt (include "prepos.quantity" $request | float64) (include "prepos.quantity" $limit | float64) }}
{{- fail (printf "%s.requests.%s (%v) must not exceed %s.limits.%s (%v): Kubernetes refuses a request above its limit; raise the limit too (or set it to null)" $path $name $request $path $name $limit) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The ServiceAccount the pods run as; empty for the namespace's default. */}}
{{- define "prepos.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "prepos.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* A pod spec's ServiceAccount fields: (list ROOT NAME), NAME the account's (empty: the namespace's default).
Each only where set, so that a chart upgrade alone leaves the pod templates (and the replicas) as they are. */}}
{{- define "prepos.podServiceAccount" -}}
{{- $root := index . 0 }}
{{- with index . 1 }}
serviceAccountName: {{ . }}
{{- end }}
{{- if not (kindIs "invalid" $root.Values.serviceAccount.automountToken) }}
automountServiceAccountToken: {{ $root.Values.serviceAccount.automountToken }}
{{- end }}
{{- end }}

{{/* Fails where a container's extraEnv repeats a name or takes one the chart sets: (list PATH ENV TAKEN SETTINGS),
PATH the values' path of ENV (a list of EnvVars), TAKEN a dict of the names the chart sets in that container to the
value that sets each, SETTINGS whether the container reads prepos settings (PREPOS_ names: they belong in prepos.env,
where the chart checks them). */}}
{{- define "prepos.checkExtraEnv" -}}
{{- $path := index . 0 }}
{{- $settings := index . 3 }}
{{- $seen := dict }}
{{- $taken := index . 2 }}
{{- range (index . 1) }}
{{- $name := .name }}
{{- if and $settings (hasPrefix "PREPOS_" $name) }}
{{- fail (printf "%s sets %s: set prepos settings in prepos.env (the chart sets some itself and checks them there)" $path $name) }}
{{- end }}
{{- if hasKey $taken $name }}
{{- fail (printf "%s sets %s, which the chart sets itself in that container (from %s): Kubernetes would keep only one of the two" $path $name (get $taken $name)) }}
{{- end }}
{{- if hasKey $seen $name }}
{{- fail (printf "%s sets %s twice" $path $name) }}
{{- end }}
{{- $_ := set $seen $name true }}
{{- end }}
{{- end }}

{{/* Fails where extra pod labels would replace the chart's own, which its selectors, Services and policies match
on: (list PATH LABELS). */}}
{{- define "prepos.checkPodLabels" -}}
{{- $path := index . 0 }}
{{- $own := list "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/managed-by" "app.kubernetes.io/component" }}
{{- range $name, $_ := index . 1 }}
{{- if has $name $own }}
{{- fail (printf "%s sets %s: the chart sets that label itself (its selectors, Services and policies match it); use another label" $path $name) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Fails where two of a container's mounts share a path, which Kubernetes refuses: (list CONTAINER MOUNTS), MOUNTS a
list of (list PATH WHAT), WHAT the value that mounts it, for the message. */}}
{{- define "prepos.checkMounts" -}}
{{- $container := index . 0 }}
{{- $seen := dict }}
{{- range index . 1 }}
{{- $path := clean (index . 0) }}
{{- if hasKey $seen $path }}
{{- fail (printf "%s and %s would both be mounted at %s in %s, which Kubernetes refuses: give them different paths" (get $seen $path) (index . 1) $path $container) }}
{{- end }}
{{- $_ := set $seen $path (index . 1) }}
{{- end }}
{{- end }}
