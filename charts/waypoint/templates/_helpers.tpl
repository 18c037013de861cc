{{- define "waypoint.name" -}}
{{- .Values.name | default "waypoint" -}}
{{- end -}}

{{- define "waypoint.serviceAccountName" -}}
{{- .Values.serviceAccount.name | default (include "waypoint.name" .) -}}
{{- end -}}

{{/* The Gateway's address: our Service's cluster-local hostname. */}}
{{/* The cluster-wide read access of this release's waypoint: unique per namespace. */}}
{{- define "waypoint.clusterRbacName" -}}
{{- printf "ztunnel-rs-waypoint-%s-%s" .Release.Namespace (include "waypoint.name" .) | trunc 253 -}}
{{- end -}}

{{- define "waypoint.hostname" -}}
{{- printf "%s.%s.svc.%s" (include "waypoint.name" .) .Release.Namespace .Values.gateway.clusterDomain -}}
{{- end -}}

{{- define "waypoint.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Labels on every object of the chart. */}}
{{- define "waypoint.labels" -}}
app.kubernetes.io/name: waypoint
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: ztunnel-rs
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Gateway API's label tying the Service, the pods (and so their service account,
     the waypoint's identity as istiod sees it) to the Gateway. */}}
{{- define "waypoint.selectorLabels" -}}
gateway.networking.k8s.io/gateway-name: {{ include "waypoint.name" . }}
{{- end -}}
