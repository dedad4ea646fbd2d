{{/* Name of the chart, overridable. */}}
{{- define "sluice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every resource name: <release>-<chart> unless overridden.
Dots (valid in a release name, not in a Service's) become dashes, and it
is cut to 52 characters so that "-controller" and "-stage" names stay
distinct within Kubernetes' 63. */}}
{{- define "sluice.fullname" -}}
{{- $full := "" }}
{{- if .Values.fullnameOverride }}
{{- $full = .Values.fullnameOverride }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- $full = .Release.Name }}
{{- else }}
{{- $full = printf "%s-%s" .Release.Name $name }}
{{- end }}
{{- end }}
{{- $full | replace "." "-" | trunc 52 | trimSuffix "-" }}
{{- end }}

{{/* Labels common to every resource. */}}
{{- define "sluice.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sluice
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component; call with (dict "ctx" $ "component" "stage"). */}}
{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Image reference; call with (dict "ctx" $ "image" .Values.stage.image). */}}
{{- define "sluice.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "sluice.controller.fullname" -}}
{{- printf "%s-controller" (include "sluice.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sluice.stage.fullname" -}}
{{- printf "%s-stage" (include "sluice.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The ConfigMap of the stage's configuration file (stage.config). */}}
{{- define "sluice.stage.configMap" -}}
{{- printf "%s-config" (include "sluice.stage.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Where the stage's configuration file is mounted. */}}
{{- define "sluice.stage.configDir" -}}
/etc/sluice/stage
{{- end }}

{{/* The stage's configuration file's volume, when stage.config has keys. */}}
{{- define "sluice.stage.configVolume" -}}
{{- if .Values.stage.config }}
- name: stage-config
  configMap:
    name: {{ include "sluice.stage.configMap" . }}
{{- end }}
{{- end }}

{{/* A pod annotation that changes with stage.config, so that the stages
restart with a new one (they read it at start only). */}}
{{- define "sluice.stage.configChecksum" -}}
{{- if .Values.stage.config }}
checksum/stage-config: {{ toYaml .Values.stage.config | sha256sum }}
{{- end }}
{{- end }}

{{- define "sluice.controller.serviceAccountName" -}}
{{- if .Values.controller.serviceAccount.create }}
{{- default (include "sluice.controller.fullname" .) .Values.controller.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.controller.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sluice.stage.serviceAccountName" -}}
{{- if .Values.stage.daemonset.serviceAccount.create }}
{{- default (include "sluice.stage.fullname" .) .Values.stage.daemonset.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.stage.daemonset.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Controller replicas: SQLite has exactly one writer. */}}
{{- define "sluice.controller.replicas" -}}
{{- if eq (include "sluice.store.type" .) "sqlite" }}1{{ else }}{{ .Values.controller.replicas | int }}{{ end }}
{{- end }}

{{/* The store type, validated. */}}
{{- define "sluice.store.type" -}}
{{- $t := .Values.store.type }}
{{- if not (has $t (list "sqlite" "postgres")) }}
{{- fail (printf "store.type must be sqlite or postgres, not %q" $t) }}
{{- end }}
{{- $t }}
{{- end }}

{{/* Secret holding the Postgres URL. */}}
{{- define "sluice.postgres.secretName" -}}
{{- if .Values.store.postgres.existingSecret }}
{{- .Values.store.postgres.existingSecret }}
{{- else if .Values.store.postgres.url }}
{{- printf "%s-postgres" (include "sluice.controller.fullname" .) }}
{{- else }}
{{- fail "store.type postgres needs store.postgres.existingSecret (a Secret with the postgres:// URL) or store.postgres.url" }}
{{- end }}
{{- end }}

{{/* ConfigMap of policies, empty when there is none. */}}
{{- define "sluice.policies.configMap" -}}
{{- if .Values.policies.existingConfigMap }}
{{- .Values.policies.existingConfigMap }}
{{- else if .Values.policies.files }}
{{- printf "%s-policies" (include "sluice.controller.fullname" .) }}
{{- end }}
{{- end }}

{{/* Secrets of the TLS material. */}}
{{- define "sluice.tls.controllerSecret" -}}
{{- required "tls.enabled needs tls.controllerSecret (a Secret with tls.crt, tls.key and ca.crt)" .Values.tls.controllerSecret }}
{{- end }}

{{/*
The stages' Secret has no default: the controller's certificate is a server
certificate (`server auth`), which the controller refuses as a client
certificate, and its key does not belong on every node and in training pods.
*/}}
{{- define "sluice.tls.stageSecret" -}}
{{- required "tls.enabled needs tls.stageSecret: a Secret with the stages' client certificate (tls.crt with the `client auth` usage, tls.key, and the CA of the controller's certificate in ca.crt); the controller's server certificate is refused as a client certificate" .Values.tls.stageSecret }}
{{- end }}

{{/*
Mode of the files of the stage's TLS Secret. The kubelet writes them as
user root and group root (the pod's fsGroup if it has one), so the mode
decides whether the stage can read its key: a stage running as root (the
mount, or runAsUser 0) reads as the owner (0400); in a pod with fsGroup the
stage has that group (0440); otherwise it is neither owner nor group and
needs the read bit for others (0444). The volume is mounted in the stage
container only, so that bit lets no one else in. A pod-wide fsGroup is not
added for it: the kubelet would also hand over every volume of the pod that
supports ownership, such as a dataset's PersistentVolumeClaim.
*/}}
{{- define "sluice.stage.tlsMode" -}}
{{- $v := .Values.stage }}
{{- $psc := $v.podSecurityContext | default dict }}
{{- $csc := $v.securityContext | default dict }}
{{- /* The image's user (docker/stage.Dockerfile) unless one is set. */}}
{{- $uid := 65532 }}
{{- if and (hasKey $psc "runAsUser") (not (kindIs "invalid" $psc.runAsUser)) }}
{{- $uid = int $psc.runAsUser }}
{{- end }}
{{- if and (hasKey $csc "runAsUser") (not (kindIs "invalid" $csc.runAsUser)) }}
{{- $uid = int $csc.runAsUser }}
{{- end }}
{{- if $v.mount.enabled }}
{{- $uid = 0 }}
{{- end }}
{{- if eq $uid 0 }}0400
{{- else if and (hasKey $psc "fsGroup") (not (kindIs "invalid" $psc.fsGroup)) }}0440
{{- else }}0444
{{- end }}
{{- end }}

{{/* TLS flags, shared by both daemons. */}}
{{- define "sluice.tls.args" -}}
- --tls-cert={{ .Values.tls.mountPath }}/tls.crt
- --tls-key={{ .Values.tls.mountPath }}/tls.key
- --tls-ca={{ .Values.tls.mountPath }}/ca.crt
{{- end }}

{{/* Secret holding the admin API's token file. */}}
{{- define "sluice.auth.secretName" -}}
{{- default (printf "%s-tokens" (include "sluice.controller.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/*
"true" when the stages are given a controller: the chart's
(controller.enabled) or one of their own (`--controller` in
stage.extraArgs, SLUICE_CONTROLLER in stage.extraEnv); empty for standalone
stages, which report no controller session all the time.
*/}}
{{- define "sluice.stage.hasController" -}}
{{- $given := .Values.controller.enabled }}
{{- range .Values.stage.extraArgs }}
{{- if hasPrefix "--controller" (toString .) }}
{{- $given = true }}
{{- end }}
{{- end }}
{{- range .Values.stage.extraEnv }}
{{- if and (kindIs "map" .) (eq (toString .name) "SLUICE_CONTROLLER") }}
{{- $given = true }}
{{- end }}
{{- end }}
{{- if $given }}true{{ end }}
{{- end }}

{{/*
A controller period (`--tick`, `--stage-timeout`: `500ms`, `1.5s`, spelled
as values.schema.json says) in milliseconds.
*/}}
{{- define "sluice.controller.millis" -}}
{{- $s := trim (toString .) }}
{{- $n := regexFind "^[0-9]+(\\.[0-9]+)?" $s | float64 }}
{{- if hasSuffix "ms" $s }}{{ $n }}{{ else }}{{ mulf $n 1000 }}{{ end }}
{{- end }}

{{/* Refuses the periods the controller refuses at start (exit 64). */}}
{{- define "sluice.controller.checkPeriods" -}}
{{- $c := .Values.controller }}
{{- $tick := include "sluice.controller.millis" $c.tick | float64 }}
{{- $timeout := include "sluice.controller.millis" $c.stageTimeout | float64 }}
{{- if eq $tick 0.0 }}
{{- fail (printf "controller.tick %q is zero: give a positive duration such as 1s" (toString $c.tick)) }}
{{- end }}
{{- if gt $tick 60000.0 }}
{{- fail (printf "controller.tick %q is too long: the control loop must run at least once a minute" (toString $c.tick)) }}
{{- end }}
{{- if lt $timeout 2000.0 }}
{{- fail (printf "controller.stageTimeout %q is under 2s: a stage that missed a few telemetry reports (it sends two a second) would be counted lost: give at least 2s" (toString $c.stageTimeout)) }}
{{- end }}
{{- if ge $tick $timeout }}
{{- fail (printf "controller.tick %q must be shorter than controller.stageTimeout %q: the control loop would notice a lost stage a tick late" (toString $c.tick) (toString $c.stageTimeout)) }}
{{- end }}
{{- end }}

{{/*
An integer value as digits. Helm holds the numbers of a values file as
floats, which print as `2e+06` from a million on; strings pass through.
*/}}
{{- define "sluice.int" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ int64 . }}{{ end }}
{{- end }}

{{/*
Refuses reader settings the stage refuses at start (exit 64): a fixed count
turns the tuner off, so it goes with none of the tuner's bounds.
*/}}
{{- define "sluice.stage.checkReaders" -}}
{{- $r := .Values.stage.readers }}
{{- if and $r.fixed (or $r.min $r.max $r.initial) }}
{{- fail (printf "stage.readers.fixed (%d) turns the reader tuner off, so it cannot go with stage.readers.min, max or initial: set either fixed, or the tuner's bounds (leave the others 0)" (int $r.fixed)) }}
{{- end }}
{{- if and $r.min $r.max (gt (int $r.min) (int $r.max)) }}
{{- fail (printf "stage.readers.min (%d) is above stage.readers.max (%d)" (int $r.min) (int $r.max)) }}
{{- end }}
{{- if and $r.initial $r.min (lt (int $r.initial) (int $r.min)) }}
{{- fail (printf "stage.readers.initial (%d) is below stage.readers.min (%d)" (int $r.initial) (int $r.min)) }}
{{- end }}
{{- if and $r.initial $r.max (gt (int $r.initial) (int $r.max)) }}
{{- fail (printf "stage.readers.initial (%d) is above stage.readers.max (%d)" (int $r.initial) (int $r.max)) }}
{{- end }}
{{- end }}

{{/*
A byte size as the stage spells it (`1GiB`, `512MB`, `800Mi`, `1.5G`) in
bytes, a float.
*/}}
{{- define "sluice.bytes" -}}
{{- $s := trim (toString .) }}
{{- $n := regexFind "^[0-9]+(\\.[0-9]+)?" $s | float64 }}
{{- $unit := trimSuffix "B" (trim (trimPrefix (regexFind "^[0-9]+(\\.[0-9]+)?" $s) $s)) }}
{{- $factors := dict "" 1 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 }}
{{- mulf $n (get $factors $unit | default 1) }}
{{- end }}

{{/*
A Kubernetes memory quantity (`1280Mi`, `1.5Gi`, `2G`, `1342177280`) in
bytes, a float; empty for a form this does not read (`1e9`), which is then
not checked here.
*/}}
{{- define "sluice.quantity" -}}
{{- $s := trim (toString .) }}
{{- if regexMatch "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$" $s }}
{{- $n := regexFind "^[0-9]+(\\.[0-9]+)?" $s | float64 }}
{{- $factors := dict "" 1 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 }}
{{- mulf $n (get $factors (trimPrefix (regexFind "^[0-9]+(\\.[0-9]+)?" $s) $s)) }}
{{- end }}
{{- end }}

{{/* Refuses a node cache that leaves the prefetch buffers less than 16MiB of
the memory budget, as the stage does at start (exit 64), and a memory limit
that leaves the stage less than 64MiB above its budget (the kernel would
kill it once its buffers fill; the stage only warns, at start). */}}
{{- define "sluice.stage.checkMemory" -}}
{{- $st := .Values.stage }}
{{- with (($st.resources).limits).memory }}
{{- $limit := include "sluice.quantity" . }}
{{- $budget := include "sluice.bytes" $st.memoryBudget | float64 }}
{{- if and $limit (lt ($limit | float64) (addf $budget 67108864.0)) }}
{{- fail (printf "stage.resources.limits.memory (%s) leaves the stage less than 64MiB above stage.memoryBudget (%s): the kernel would kill it once its buffers fill. Raise the limit (budget + 64MiB, plus an eighth of the budget, 256MiB at most, for the pages shared memory keeps) or lower memoryBudget" (toString .) (toString $st.memoryBudget)) }}
{{- end }}
{{- end }}
{{- /* The buffer bounds within what the cache leaves of the budget,
with the stage's defaults (min 4MiB, max all of it, initial 256MiB), as it
checks them at start. */}}
{{- $left := subf (include "sluice.bytes" $st.memoryBudget | float64) (include "sluice.bytes" ($st.cache.memory | default "0") | float64) }}
{{- $b := $st.buffer | default dict }}
{{- $bmin := minf (ternary (include "sluice.bytes" $b.min | float64) 4194304.0 (not (empty $b.min))) $left }}
{{- $bmax := ternary (include "sluice.bytes" $b.max | float64) $left (not (empty $b.max)) }}
{{- $binit := ternary (include "sluice.bytes" $b.initial | float64) (minf 268435456.0 $left) (not (empty $b.initial)) }}
{{- if or (gt $bmin $bmax) (gt $bmax $left) }}
{{- fail (printf "stage.buffer: min (%s) and max (%s) must keep min <= max <= stage.memoryBudget (%s) less stage.cache.memory (%s), or the stage refuses to start" ($b.min | default "4MiB") ($b.max | default "the budget") (toString $st.memoryBudget) ($st.cache.memory | default "0")) }}
{{- end }}
{{- if or (lt $binit $bmin) (gt $binit $bmax) }}
{{- fail (printf "stage.buffer.initial (%s) is outside stage.buffer.min..max (%s..%s), or the stage refuses to start: set initial between them (unset, it is 256MiB or the budget, whichever is less)" ($b.initial | default "unset") ($b.min | default "4MiB") ($b.max | default "the budget")) }}
{{- end }}
{{- with $st.cache.memory }}
{{- $cache := include "sluice.bytes" . | float64 }}
{{- $budget := include "sluice.bytes" $st.memoryBudget | float64 }}
{{- if and (gt $cache 0.0) (gt (addf $cache 16777216.0) $budget) }}
{{- fail (printf "stage.cache.memory (%s) leaves the prefetch buffers less than 16MiB of stage.memoryBudget (%s), and the stage would refuse to start: raise memoryBudget (and the memory limit with it) or lower cache.memory" (toString .) (toString $st.memoryBudget)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The controller URL stages connect to. */}}
{{- define "sluice.controller.url" -}}
{{- printf "%s://%s.%s.svc:%d" (ternary "https" "http" .Values.tls.enabled) (include "sluice.controller.fullname" .) .Release.Namespace (.Values.controller.grpcPort | int) }}
{{- end }}

{{/*
"true" when the stage has a disk tier (stage.cache.disk.hostPath and .size
both set), empty when it has none; fails when only one of the two is set
(values.schema.json says so first, unless schema validation is skipped).
*/}}
{{- define "sluice.stage.cacheDisk" -}}
{{- $d := .Values.stage.cache.disk }}
{{- if and $d.hostPath $d.size }}true
{{- else if or $d.hostPath $d.size }}
{{- fail "stage.cache.disk: set both hostPath (a directory on the node) and size (how much of it the cache may fill, e.g. 200GiB), or neither" }}
{{- end }}
{{- end }}

{{/* Where the disk tier's host directory is mounted in the stage. */}}
{{- define "sluice.stage.cacheDir" -}}
/var/cache/sluice
{{- end }}

{{/*
Refuses a directory the DaemonSet's stage gets at the same path as on the
node (the mount's parent, the order files' directory) where it would hide
a directory of the image or nest with one of the stage's other volumes (a
volume mounted inside a Bidirectional one would leak back to the node):
call with (dict "ctx" $ "value" <the value, for the message> "path"
<cleaned path>).
*/}}
{{- define "sluice.stage.mount.checkPath" -}}
{{- $ctx := .ctx }}
{{- $p := .path }}
{{- $own := list "/usr" "/proc" "/sys" "/dev/fuse" "/run/sluice" }}
{{- range $ctx.Values.stage.datasets }}
{{- if not .s3 }}
{{- $own = append $own (printf "/data/%s" .name) }}
{{- end }}
{{- end }}
{{- if include "sluice.stage.cacheDisk" $ctx }}
{{- $own = append $own (include "sluice.stage.cacheDir" $ctx) }}
{{- end }}
{{- if $ctx.Values.tls.enabled }}
{{- $own = append $own (clean $ctx.Values.tls.mountPath) }}
{{- end }}
{{- $bad := has $p (list "/bin" "/boot" "/dev" "/etc" "/lib" "/lib64" "/root" "/sbin") }}
{{- range $own }}
{{- if or (eq $p .) (hasPrefix (printf "%s/" .) $p) (hasPrefix (printf "%s/" $p) .) (eq $p "/") }}
{{- $bad = true }}
{{- end }}
{{- end }}
{{- if $bad }}
{{- fail (printf "%s: the stage gets %s at the same path, which must neither hide a directory of its image (/, /bin, /etc, /usr, /dev, ...) nor contain or lie inside one of its other mounts (%s); pick another directory, e.g. /var/lib/sluice/mnt for stage.mount.hostPath" .value $p (join ", " $own)) }}
{{- end }}
{{- end }}

{{/*
Where the DaemonSet's stage mounts the data sets, as a dict: "dir" (the
node's stage.mount.hostPath, the same path in the stage), "parent" (its
parent directory, the hostPath volume the stage gets: a stale mount at
"dir" itself would keep the container from starting), "orders" (the order
files' directory, or empty) and "ordersVolume" (true when "orders" needs a
volume of its own, i.e. is not inside "parent"). Empty when the mount is
off. Use with `include ... | fromYaml`.
*/}}
{{- define "sluice.stage.mount.node" -}}
{{- $m := .Values.stage.mount }}
{{- if $m.enabled }}
{{- if not (regexMatch "^/[^/]+(/[^/]+)+/?$" $m.hostPath) }}
{{- fail (printf "stage.mount.hostPath %q: DaemonSet mode needs an absolute directory at least two levels deep (the stage gets its parent), e.g. /var/lib/sluice/mnt" $m.hostPath) }}
{{- end }}
{{- $dir := clean $m.hostPath }}
{{- $parent := dir $dir }}
{{- include "sluice.stage.mount.checkPath" (dict "ctx" . "value" (printf "stage.mount.hostPath %q" $m.hostPath) "path" $parent) }}
{{- $orders := "" }}
{{- $ordersVolume := false }}
{{- with $m.orders.hostPath }}
{{- $orders = clean . }}
{{- if not (isAbs $orders) }}
{{- fail (printf "stage.mount.orders.hostPath %q must be an absolute directory" .) }}
{{- end }}
{{- if or (eq $orders $parent) (eq $orders $dir) (hasPrefix (printf "%s/" $dir) $orders) (hasPrefix (printf "%s/" $orders) $parent) }}
{{- fail (printf "stage.mount.orders.hostPath %q must be neither stage.mount.hostPath, inside it (the read-only mount), nor its parent or above (the order files' directory would hold the mount)" .) }}
{{- end }}
{{- $ordersVolume = not (hasPrefix (printf "%s/" $parent) $orders) }}
{{- if $ordersVolume }}
{{- include "sluice.stage.mount.checkPath" (dict "ctx" $ "value" (printf "stage.mount.orders.hostPath %q" .) "path" $orders) }}
{{- end }}
{{- end }}
dir: {{ $dir | quote }}
parent: {{ $parent | quote }}
orders: {{ $orders | quote }}
ordersVolume: {{ $ordersVolume }}
{{- end }}
{{- end }}

{{/* Where the sidecar's stage mounts the data sets: a directory on the emptyDir it shares with the trainer. */}}
{{- define "sluice.stage.mount.sidecarVolume" -}}
/mnt/sluice
{{- end }}
{{- define "sluice.stage.mount.sidecarDir" -}}
/mnt/sluice/data
{{- end }}

{{/*
The stage container, shared by the DaemonSet and the sidecar example.
Call with (dict "ctx" $ "name" "stage" "stageId" <env source>), plus
"cacheDisk" true where the pod has the disk tier's volume (the DaemonSet:
sidecars on one node would share its directory), and "mount" where the
stage mounts the data sets (stage.mount.enabled): a dict with "dir"
(`--mount`), "volume" (where the `mount` volume goes, mounted with
Bidirectional propagation: a parent of "dir"), "orders" (`--mount-orders`,
or empty) and "ordersVolume" (true: the `mount-orders` volume goes at
"orders").
The caller provides the volumes: socket, datasets (dataset-<name>), tls,
cache-disk, mount, mount-orders, fuse.
*/}}
{{- define "sluice.stage.container" -}}
{{- $ctx := .ctx }}
{{- $v := $ctx.Values.stage }}
{{- include "sluice.stage.checkReaders" $ctx }}
{{- include "sluice.stage.checkMemory" $ctx }}
{{- if and $ctx.Values.tls.enabled (not (include "sluice.stage.hasController" $ctx)) }}
{{- fail "tls.enabled secures the stages' session with a controller, and these stages have none (controller.enabled is false and no --controller in stage.extraArgs or SLUICE_CONTROLLER in stage.extraEnv): the stage refuses --tls-* without --controller. Set tls.enabled false, or give the stages a controller" }}
{{- end }}
- name: {{ .name }}
  image: {{ include "sluice.image" (dict "ctx" $ctx "image" $v.image) }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- with .restartPolicy }}
  restartPolicy: {{ . }}
  {{- end }}
  args:
    - --socket=/run/sluice/stage.sock
    {{- if $v.config }}
    - --config={{ include "sluice.stage.configDir" $ctx }}/stage.yaml
    {{- end }}
    - --metrics-addr=0.0.0.0:{{ $v.metricsPort }}
    - --memory-budget={{ $v.memoryBudget }}
    {{- $cacheDisk := and .cacheDisk (include "sluice.stage.cacheDisk" $ctx) }}
    {{- /* A size of 0 ("0", "0MiB") is no memory tier, as for the stage. */}}
    {{- $cacheMemory := $v.cache.memory }}
    {{- if and $cacheMemory (regexMatch "^[0.]+ *[A-Za-z]*$" (toString $cacheMemory)) }}
    {{- $cacheMemory = "" }}
    {{- end }}
    {{- if or $cacheMemory $cacheDisk }}
    {{- with $cacheMemory }}
    - --cache-memory={{ . }}
    {{- end }}
    - --cache-policy={{ $v.cache.policy }}
    {{- end }}
    {{- if $cacheDisk }}
    - --cache-dir={{ include "sluice.stage.cacheDir" $ctx }}
    - --cache-disk={{ $v.cache.disk.size }}
    {{- end }}
    - --direct-io={{ $v.directIO }}
    {{- range $v.datasets }}
    {{- if .s3 }}
    - --dataset={{ .name }}={{ .s3 }}
    {{- else }}
    - --dataset={{ .name }}=/data/{{ .name }}
    {{- end }}
    {{- end }}
    {{- with $v.s3.endpoint }}
    - --s3-endpoint={{ . }}
    {{- end }}
    {{- with $v.s3.region }}
    - --s3-region={{ . }}
    {{- end }}
    {{- with $v.s3.pathStyle }}
    - --s3-path-style={{ . }}
    {{- end }}
    {{- with $v.s3.deadline }}
    - --s3-deadline={{ . }}
    {{- end }}
    {{- with .mount }}
    - --mount={{ .dir }}
    {{- with $v.mount.job }}
    - --mount-job={{ . }}
    {{- end }}
    {{- with .orders }}
    - --mount-orders={{ . }}
    {{- end }}
    {{- end }}
    {{- if $v.tcp.enabled }}
    {{- if eq (int $v.tcp.port) (int $v.metricsPort) }}
    {{- fail (printf "stage.tcp.port and stage.metricsPort are both %d: the stage cannot listen twice on one port (it would exit at start); give them two ports" (int $v.tcp.port)) }}
    {{- end }}
    - --listen=0.0.0.0:{{ $v.tcp.port }}
    {{- end }}
    {{- with $v.rateLimit }}
    - --rate-limit={{ . }}
    {{- end }}
    {{- with $v.opsLimit }}
    - --ops-limit={{ include "sluice.int" . }}
    {{- end }}
    {{- with $v.readers.fixed }}
    - --readers={{ . }}
    {{- end }}
    {{- with $v.readers.min }}
    - --min-readers={{ . }}
    {{- end }}
    {{- with $v.readers.max }}
    - --max-readers={{ . }}
    {{- end }}
    {{- with $v.readers.initial }}
    - --initial-readers={{ . }}
    {{- end }}
    {{- with $v.buffer.min }}
    - --min-buffer={{ . }}
    {{- end }}
    {{- with $v.buffer.max }}
    - --max-buffer={{ . }}
    {{- end }}
    {{- with $v.buffer.initial }}
    - --initial-buffer={{ . }}
    {{- end }}
    {{- range $k, $val := $v.labels }}
    - --label={{ $k }}={{ $val }}
    {{- end }}
    {{- range $k, $val := .labels }}
    - --label={{ $k }}={{ $val }}
    {{- end }}
    {{- if $ctx.Values.controller.enabled }}
    - --controller={{ include "sluice.controller.url" $ctx }}
    {{- end }}
    {{- if $ctx.Values.tls.enabled }}
    {{- include "sluice.tls.args" $ctx | nindent 4 }}
    {{- end }}
    {{- with $v.extraArgs }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  env:
    - name: SLUICE_LOG
      value: {{ $v.logLevel | quote }}
    - name: SLUICE_NODE
      valueFrom:
        fieldRef:
          fieldPath: spec.nodeName
    - name: SLUICE_STAGE_ID
      valueFrom:
        fieldRef:
          fieldPath: {{ .stageIdField }}
    {{- with $v.s3.credentialsSecret }}
    - name: AWS_ACCESS_KEY_ID
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $v.s3.accessKeyIdKey }}
    - name: AWS_SECRET_ACCESS_KEY
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $v.s3.secretAccessKeyKey }}
    {{- end }}
    {{- with $v.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: metrics
      containerPort: {{ $v.metricsPort }}
      protocol: TCP
    {{- if $v.tcp.enabled }}
    - name: trainers
      containerPort: {{ $v.tcp.port }}
      protocol: TCP
    {{- end }}
  {{- if .startupProbe }}
  startupProbe:
    httpGet:
      path: /readyz
      port: metrics
    periodSeconds: 1
    failureThreshold: 60
  {{- end }}
  livenessProbe:
    httpGet:
      path: /healthz
      port: metrics
    periodSeconds: {{ $v.livenessProbe.periodSeconds }}
    failureThreshold: {{ $v.livenessProbe.failureThreshold }}
  readinessProbe:
    httpGet:
      path: /readyz
      port: metrics
    periodSeconds: {{ $v.readinessProbe.periodSeconds }}
    failureThreshold: {{ $v.readinessProbe.failureThreshold }}
  resources:
    {{- toYaml $v.resources | nindent 4 }}
  {{- if .mount }}
  # The mount: mount(2) needs root with CAP_SYS_ADMIN, and Kubernetes allows
  # the Bidirectional propagation that takes the mount out of this container
  # only in privileged containers. The group stays the pod's.
  {{- $sc := omit $v.securityContext "privileged" "allowPrivilegeEscalation" "capabilities" "runAsUser" "runAsNonRoot" }}
  {{- $_ := set $sc "privileged" true }}
  {{- $_ := set $sc "allowPrivilegeEscalation" true }}
  {{- $_ := set $sc "runAsUser" 0 }}
  {{- $_ := set $sc "runAsNonRoot" false }}
  securityContext:
    {{- toYaml $sc | nindent 4 }}
  {{- else }}
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: socket
      mountPath: /run/sluice
    {{- if $v.config }}
    - name: stage-config
      mountPath: {{ include "sluice.stage.configDir" $ctx }}
      readOnly: true
    {{- end }}
    {{- range $v.datasets }}
    {{- if not .s3 }}
    - name: dataset-{{ .name }}
      mountPath: /data/{{ .name }}
      readOnly: true
    {{- end }}
    {{- end }}
    {{- if $cacheDisk }}
    - name: cache-disk
      mountPath: {{ include "sluice.stage.cacheDir" $ctx }}
    {{- end }}
    {{- if $ctx.Values.tls.enabled }}
    - name: tls
      mountPath: {{ $ctx.Values.tls.mountPath }}
      readOnly: true
    {{- end }}
    {{- with .mount }}
    - name: mount
      mountPath: {{ .volume }}
      mountPropagation: Bidirectional
    {{- if .ordersVolume }}
    - name: mount-orders
      mountPath: {{ .orders }}
    {{- end }}
    - name: fuse
      mountPath: /dev/fuse
    {{- end }}
{{- end }}

{{/* The /dev/fuse volume of a stage with the mount. */}}
{{- define "sluice.stage.fuseVolume" -}}
- name: fuse
  hostPath:
    path: /dev/fuse
    type: CharDevice
{{- end }}

{{/* The datasets' volumes. */}}
{{- define "sluice.stage.datasetVolumes" -}}
{{- $seen := dict }}
{{- range .Values.stage.datasets }}
{{- if hasKey $seen .name }}
{{- fail (printf "stage.datasets: %q is given twice (the stage would refuse to start): give each data set one entry" .name) }}
{{- end }}
{{- $_ := set $seen .name true }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" .name) }}
{{- fail (printf "stage.datasets: name %q must be lowercase letters, digits and '-' (it names a volume)" .name) }}
{{- end }}
{{- if not .s3 }}
- name: dataset-{{ .name }}
  {{- if .volume }}
  {{- toYaml .volume | nindent 2 }}
  {{- else }}
  hostPath:
    path: {{ required (printf "stage.datasets: %s needs hostPath, volume or s3" .name) .hostPath }}
    type: Directory
  {{- end }}
{{- end }}
{{- end }}
{{- end }}
