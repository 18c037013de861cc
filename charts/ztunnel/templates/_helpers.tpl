{{/*
The values every template reads: .Values with Istio's ztunnel chart semantics applied, as
JSON (templates: `$v := include "ztunnel.values" . | fromJson`). Precedence, highest first,
as in Istio's chart:
  1. a value set at the top level (one that differs from this chart's values.yaml);
  2. the same key under `global` (Istio flattens `global.*` onto its values);
  3. what `profile` / `platform` imply for a node proxy;
  4. a value under `_internal_defaults_do_not_set` (the shape of `helm show values` of
     Istio's chart);
  5. this chart's values.yaml.
A value is "unset" when absent or equal to values.yaml's: a value explicitly set to the
chart default is indistinguishable from the default, which gives the same result.
*/}}
{{- define "ztunnel.values" -}}
{{- /* Helm hides values.yaml from .Files; files/values-defaults.yaml links to it. */ -}}
{{- $chart := .Files.Get "files/values-defaults.yaml" | fromYaml -}}
{{- if not $chart.resourceScope -}}
{{- fail "files/values-defaults.yaml (a link to values.yaml) is missing from the chart" -}}
{{- end -}}
{{- $v := deepCopy .Values -}}
{{- $internal := (get $v "_internal_defaults_do_not_set") | default dict -}}
{{- $_ := unset $v "_internal_defaults_do_not_set" -}}
{{- $global := $v.global | default dict -}}
{{- /* 2. global.* (only the user's own; values.yaml has no global defaults). Not
global.variant: Istio's images' variants (the ambient profile's distroless), which
ours do not have. */ -}}
{{- range $k, $gv := omit $global "networkPolicy" "profile" "platform" "variant" -}}
{{- if or (not (hasKey $v $k)) (eq (toJson (get $v $k)) (toJson (get $chart $k))) -}}
{{- $_ := set $v $k $gv -}}
{{- end -}}
{{- end -}}
{{- /* 3. profile / platform: only their effect on ztunnel (see values.yaml) */ -}}
{{- $profile := dict -}}
{{- $prof := coalesce $v.profile $global.profile "" -}}
{{- if eq $prof "ambient" -}}
{{- $_ := set $profile "meshConfig" (dict "defaultConfig" (dict "proxyMetadata" (dict "ISTIO_META_ENABLE_HBONE" "true"))) -}}
{{- else if eq $prof "preview" -}}
{{- $_ := set $profile "meshConfig" (dict "defaultConfig" (dict "proxyMetadata" (dict "ISTIO_META_DNS_CAPTURE" "true"))) -}}
{{- end -}}
{{- $plat := coalesce $v.platform $global.platform "" -}}
{{- if eq $plat "openshift" -}}
{{- $_ := set $profile "seLinuxOptions" (dict "type" "spc_t") -}}
{{- else if eq $plat "gke" -}}
{{- $_ := set $profile "resourceQuotas" (dict "enabled" true) -}}
{{- end -}}
{{- range $k, $pv := $profile -}}
{{- if or (not (hasKey $v $k)) (eq (toJson (get $v $k)) (toJson (get $chart $k))) -}}
{{- $_ := set $v $k (mustMergeOverwrite (deepCopy ((get $v $k) | default dict)) $pv) -}}
{{- end -}}
{{- end -}}
{{- /* 4. _internal_defaults_do_not_set */ -}}
{{- range $k, $iv := omit $internal "global" -}}
{{- if or (not (hasKey $v $k)) (eq (toJson (get $v $k)) (toJson (get $chart $k))) -}}
{{- $_ := set $v $k $iv -}}
{{- end -}}
{{- end -}}
{{- $_ := set $v "global" (mustMergeOverwrite (deepCopy ((get $internal "global") | default dict)) $global) -}}
{{- $_ := set $v "profile" $prof -}}
{{- $_ := set $v "platform" $plat -}}
{{- /* Derived values. */ -}}
{{- $ns := $v.istioNamespace | default "istio-system" -}}
{{- $istiod := printf "istiod%s.%s.svc:15012" (ternary "" (printf "-%s" $v.revision) (empty $v.revision)) $ns -}}
{{- $_ := set $v "xdsAddress" ($v.xdsAddress | default $istiod) -}}
{{- /* As Istio's ztunnel: the CA is the xDS server unless set. */ -}}
{{- $_ := set $v "caAddress" ($v.caAddress | default $v.xdsAddress) -}}
{{- $_ := set $v "clusterId" (coalesce $v.clusterId ($v.multiCluster).clusterName "Kubernetes") -}}
{{- $_ := set $v "trustBundleConfigMap" (coalesce $v.trustBundleConfigMap $v.trustBundleName "istio-ca-root-cert") -}}
{{- $_ := set $v "image" (include "ztunnel.image" (dict "v" $v "appVersion" .Chart.AppVersion) | fromJson) -}}
{{- toJson $v -}}
{{- end -}}

{{/*
The image, as Istio's chart builds it: `image` containing a "/" is used whole, else
<hub>/<image>:<tag>[-<variant>]. Our own form `image: {repository, tag, pullPolicy}` works
too. Istio's registries publish Istio's ztunnel, not this one: a hub (or whole image)
pointing there, as a values file written for Istio's chart carries, is replaced by this
chart's image and reported in NOTES.txt.
*/}}
{{- define "ztunnel.image" -}}
{{- $v := .v -}}
{{- $ourHub := "ztunnel-rs.local" -}}
{{- $repo := "" -}}
{{- $tag := $v.tag | default "" -}}
{{- $policy := $v.imagePullPolicy | default "" -}}
{{- if kindIs "map" $v.image -}}
{{- $repo = $v.image.repository | default (printf "%s/ztunnel" ($v.hub | default $ourHub)) -}}
{{- $tag = $v.image.tag | default $tag -}}
{{- $policy = $v.image.pullPolicy | default $policy -}}
{{- else if contains "/" ($v.image | default "") -}}
{{- $repo = $v.image -}}
{{- else -}}
{{- $repo = printf "%s/%s" ($v.hub | default $ourHub) ($v.image | default "ztunnel") -}}
{{- end -}}
{{- $full := "" -}}
{{- if and (not (kindIs "map" $v.image)) (contains "/" ($v.image | default "")) -}}
{{- $full = $repo -}}
{{- else -}}
{{- $full = printf "%s:%s%s" $repo ($tag | default .appVersion) (ternary "" (printf "-%s" ($v.variant | default "")) (empty $v.variant)) -}}
{{- end -}}
{{- $replaced := "" -}}
{{- if regexMatch "^((docker\\.io/)?istio|gcr\\.io/istio-(release|testing)|registry\\.istio\\.io(/[^/]+)?)/(ztunnel|proxyv2)(:|@|$)" $full -}}
{{- $replaced = $full -}}
{{- $full = printf "%s/ztunnel:%s" $ourHub .appVersion -}}
{{- end -}}
{{- toJson (dict "ref" $full "pullPolicy" ($policy | default "IfNotPresent") "replaced" $replaced) -}}
{{- end -}}

{{/* Name of the DaemonSet and its ServiceAccount. Argument: the values ($v). */}}
{{- define "ztunnel.name" -}}
{{- .resourceName | default "ztunnel" -}}
{{- end -}}

{{/* Labels on every object of the chart. Argument: dict "v" $v "root" $. */}}
{{- define "ztunnel.labels" -}}
app.kubernetes.io/name: ztunnel
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: ztunnel-rs
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- with .v.revision }}
istio.io/rev: {{ . | quote }}
{{- end }}
{{- with .v.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Annotations on the top-level objects (Istio's chart puts istio.io/rev here too). */}}
{{- define "ztunnel.annotations" -}}
{{- $a := deepCopy (.annotations | default dict) -}}
{{- with .revision }}{{ $_ := set $a "istio.io/rev" . }}{{ end -}}
{{- with $a -}}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Whether resourceScope lets this chart render namespaced / cluster-scoped objects. */}}
{{- define "ztunnel.namespaced" -}}
{{- if has (.resourceScope | default "all") (list "all" "namespace") }}true{{ end -}}
{{- end -}}
{{- define "ztunnel.clusterScoped" -}}
{{- if has (.resourceScope | default "all") (list "all" "cluster") }}true{{ end -}}
{{- end -}}

{{/* Capabilities: what Istio's ztunnel needs, plus what eBPF capture needs. */}}
{{- define "ztunnel.capabilities" -}}
- NET_ADMIN  # nftables rules, ip rules/routes in pod netns; SO_MARK; IP_TRANSPARENT
- SYS_ADMIN  # setns() into each enrolled pod's network namespace
- NET_RAW    # transparent sockets for TPROXY-redirected connections
{{- if eq .captureMode "ebpf" }}
- BPF           # load programs, create maps
- PERFMON       # verifier features reserved to perfmon-capable loaders
- SYS_RESOURCE  # raise RLIMIT_MEMLOCK for map memory on older kernels
{{- end }}
{{- end -}}
