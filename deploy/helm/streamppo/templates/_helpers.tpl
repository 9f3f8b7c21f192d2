{{- define "streamppo.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "streamppo.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one role: (dict "root" $ "role" "scorer") */}}
{{- define "streamppo.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "streamppo.saslSecretName" -}}
{{- .Values.kafka.sasl.existingSecret | default (printf "%s-kafka" (include "streamppo.fullname" .)) -}}
{{- end -}}

{{- define "streamppo.usesSasl" -}}
{{- if or .Values.kafka.sasl.existingSecret .Values.kafka.sasl.password -}}true{{- end -}}
{{- end -}}

{{- define "streamppo.sharedClaim" -}}
{{- .Values.sharedStorage.existingClaim | default (printf "%s-shared" (include "streamppo.fullname" .)) -}}
{{- end -}}

{{/* The runs a release trains: the names in fleet.runs, or one run ("") from `config`. */}}
{{- define "streamppo.runs" -}}
{{- if .Values.fleet.runs }}{{ keys .Values.fleet.runs | sortAlpha | toJson }}{{ else }}[""]{{ end -}}
{{- end -}}

{{/* A fleet's arguments for one role: (dict "root" $ "role" "scorer") -> fleet scorer --runs /runs --share ... */}}
{{- define "streamppo.fleetArgs" -}}
{{- $args := list "fleet" .role "--runs" "/runs" }}
{{- range $name, $weight := .root.Values.fleet.shares }}
{{- $args = concat $args (list "--share" (printf "%s=%v" $name $weight)) }}
{{- end }}
{{- range $name, $tokens := .root.Values.fleet.quotas }}
{{- $args = concat $args (list "--quota" (printf "%s=%v" $name $tokens)) }}
{{- end }}
{{- toJson $args }}
{{- end -}}

{{/* The container of one role: (dict "root" $ "role" "scorer" "args" list "spec" .Values.scorer), and "fleet" true for
     a replica serving every run of fleet.runs. */}}
{{- define "streamppo.container" -}}
{{- $head := list .role "--config" "/config/run.yaml" }}
{{- if .fleet }}
{{- $head = include "streamppo.fleetArgs" . | fromJsonArray }}
{{- end }}
- name: {{ .role }}
  image: "{{ .root.Values.image.repository }}:{{ .root.Values.image.tag }}"
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  args:
    {{- toYaml (concat $head .args .spec.extraArgs) | nindent 4 }}
  {{- if include "streamppo.usesSasl" .root }}
  env:
    - name: STREAMPPO_KAFKA_PASSWORD
      valueFrom:
        secretKeyRef:
          name: {{ include "streamppo.saslSecretName" .root }}
          key: password
  {{- end }}
  {{- if ne .role "feed" }}
  ports:
    - name: metrics
      containerPort: {{ .root.Values.metrics.port }}
    {{- if eq .role "gateway" }}
    - name: http
      containerPort: {{ .spec.port }}
    {{- end }}
  readinessProbe:
    httpGet:
      path: /metrics
      port: metrics
    periodSeconds: 10
  {{- end }}
  resources:
    {{- toYaml .spec.resources | nindent 4 }}
  securityContext:
    {{- toYaml .root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: config
      mountPath: /config
      readOnly: true
    - name: shared
      mountPath: /shared
    - name: shm   # vLLM's engine needs more /dev/shm than a container's 64 MiB (as compose's shm_size: 1gb)
      mountPath: /dev/shm
    {{- if .fleet }}
    - name: runs
      mountPath: /runs
      readOnly: true
    {{- end }}
    {{- if eq .role "learner" }}
    - name: checkpoints
      mountPath: /checkpoints
    {{- end }}
{{- end -}}

{{/* Pod-level settings shared by every role: (dict "root" $ "spec" .Values.scorer); "run": the fleet run whose
     config is /config/run.yaml; "fleet" true: every run's config under /runs. */}}
{{- define "streamppo.podSpec" -}}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ .root.Values.terminationGracePeriodSeconds }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: config
    configMap:
      {{- if .run }}
      name: {{ include "streamppo.fullname" .root }}-runs
      items:
        - key: {{ .run }}.yaml
          path: run.yaml
      {{- else }}
      name: {{ include "streamppo.fullname" .root }}-config
      {{- end }}
  {{- if .fleet }}
  - name: runs
    configMap:
      name: {{ include "streamppo.fullname" .root }}-runs
  {{- end }}
  - name: shared
    persistentVolumeClaim:
      claimName: {{ include "streamppo.sharedClaim" .root }}
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: 1Gi
{{- end -}}
