{{- define "gpuwarden.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpuwarden.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "gpuwarden.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "gpuwarden.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "gpuwarden.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuwarden.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gpuwarden.commonLabels" -}}
{{ include "gpuwarden.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- /* The exporter's objects; the fleet Deployment's pods carry component: fleet, so no selector mixes them. */}}
{{- define "gpuwarden.exporterSelectorLabels" -}}
{{ include "gpuwarden.selectorLabels" . }}
app.kubernetes.io/component: exporter
{{- end }}

{{- define "gpuwarden.labels" -}}
{{ include "gpuwarden.commonLabels" . }}
app.kubernetes.io/component: exporter
{{- end }}

{{- define "gpuwarden.fleetSelectorLabels" -}}
{{ include "gpuwarden.selectorLabels" . }}
app.kubernetes.io/component: fleet
{{- end }}

{{- define "gpuwarden.fleetLabels" -}}
{{ include "gpuwarden.commonLabels" . }}
app.kubernetes.io/component: fleet
{{- end }}

{{- define "gpuwarden.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gpuwarden.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "gpuwarden.webConfigSecret" -}}
{{- default (printf "%s-web-config" (include "gpuwarden.fullname" .)) .Values.webConfig.existingSecret }}
{{- end }}

{{- define "gpuwarden.fleetWebConfigSecret" -}}
{{- default (printf "%s-fleet-web-config" (include "gpuwarden.fullname" .)) .Values.fleet.webConfig.existingSecret }}
{{- end }}

{{- define "gpuwarden.fleetName" -}}
{{- printf "%s-fleet" (include "gpuwarden.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpuwarden.scheme" -}}
{{- if and .Values.webConfig.enabled .Values.webConfig.tls }}HTTPS{{ else }}HTTP{{ end }}
{{- end }}

{{- define "gpuwarden.monitoringAPI" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end }}
{{- end }}

{{/*
The labels Prometheus and Grafana select gpuwarden's monitoring objects by: `release: <releaseLabel>` (what
kube-prometheus-stack's Prometheus selects ServiceMonitors, PodMonitors and PrometheusRules by), under the
object's own additionalLabels. Call with (dict "root" $ "extra" <additionalLabels>).
*/}}
{{- define "gpuwarden.monitoringLabels" -}}
{{- $labels := dict -}}
{{- with .root.Values.releaseLabel }}{{- $_ := set $labels "release" . -}}{{- end -}}
{{- $labels = merge (deepCopy (.extra | default dict)) $labels -}}
{{- if $labels }}{{ toYaml $labels }}{{ end -}}
{{- end -}}
