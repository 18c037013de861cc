{{/* Name of the DaemonSet and its ServiceAccount. */}}
{{- define "ztunnel.name" -}}
{{- .Values.resourceName | default "ztunnel" -}}
{{- end -}}

{{/* Labels on every object of the chart. */}}
{{- define "ztunnel.labels" -}}
app.kubernetes.io/name: ztunnel
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: ztunnel-rs
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "ztunnel.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Capabilities: what Istio's ztunnel needs, plus what eBPF capture needs. */}}
{{- define "ztunnel.capabilities" -}}
- NET_ADMIN  # nftables rules, ip rules/routes in pod netns; SO_MARK; IP_TRANSPARENT
- SYS_ADMIN  # setns() into each enrolled pod's network namespace
- NET_RAW    # transparent sockets for TPROXY-redirected connections
{{- if eq .Values.captureMode "ebpf" }}
- BPF           # load programs, create maps
- PERFMON       # verifier features reserved to perfmon-capable loaders
- SYS_RESOURCE  # raise RLIMIT_MEMLOCK for map memory on older kernels
{{- end }}
{{- end -}}
