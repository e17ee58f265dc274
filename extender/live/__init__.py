"""Live mode: the Kubernetes API server is vramsched's only source of truth.

- `api_client`: the few API calls made (`KubeApi`), over the official client (`ClientApi`);
- `informer`: list + watch of one resource in a thread, resumed, relisted on 410, backed off;
- `source`: `LiveSource` feeds `ClusterState` from the two informers on the event loop (so the
  ledger has a single owner and no lock), and `WatchedPods` tells the service pods come from it;
- `binder`: `KubeBinder` writes the assignment annotations, the pin ConfigMap, then the Binding;
- `events`: `EventRecorder` posts one `VramschedAssigned` Event per bind, off the bind path;
- `gate`: `SyncGate` holds the service's verbs until the first sync (`live_service` composes
  service, source and gate);
- `versions`: what differs with the control plane's version;
- with `serve --repack`: `repack` (evict a few movable pods so a blocked pod fits, one plan at a
  time), `evictions` (the Eviction API, so PodDisruptionBudgets hold), `nominating` (the plan
  source that follows a running repack plan).
"""
