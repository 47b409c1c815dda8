//! A pod as the watch reads it: k8s-openapi's [`Pod`] without `metadata.managedFields`.
//!
//! A real API server's pods carry `managedFields` (an entry per field manager: the Job
//! controller, the scheduler, the kubelet, the agent's own condition write), each with the set of
//! fields it owns as a tree of JSON objects, often as large as the rest of the pod. The agent never
//! reads them. [`Pod`]'s own deserializer builds that tree (a `serde_json::Value` per field)
//! for every pod of every list and watch event, only for the agent to drop it: a profile of a
//! 110-pod round put about 3 % of the agent's CPU there. [`LeanPod`] skips them unread, as serde
//! skips any field it does not know, and is otherwise the same pod.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use serde::{Deserialize, Deserializer};

/// A pod read without its `managedFields` ([module docs](self)); [`LeanPod::into_pod`] gives the
/// [`Pod`] the rest of the agent reads. Only read, never written: it has no `Serialize`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LeanPod(pub Pod);

impl LeanPod {
    pub fn into_pod(self) -> Pod {
        self.0
    }
}

impl k8s_openapi::Resource for LeanPod {
    const API_VERSION: &'static str = <Pod as k8s_openapi::Resource>::API_VERSION;
    const GROUP: &'static str = <Pod as k8s_openapi::Resource>::GROUP;
    const KIND: &'static str = <Pod as k8s_openapi::Resource>::KIND;
    const VERSION: &'static str = <Pod as k8s_openapi::Resource>::VERSION;
    const URL_PATH_SEGMENT: &'static str = <Pod as k8s_openapi::Resource>::URL_PATH_SEGMENT;
    type Scope = <Pod as k8s_openapi::Resource>::Scope;
}

impl k8s_openapi::Metadata for LeanPod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.0.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.0.metadata
    }
}

/// The pod's fields as the wire has them; `apiVersion` and `kind` are checked as [`Pod`]'s own
/// deserializer checks them (a list's items have neither).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Wire {
    api_version: Option<String>,
    kind: Option<String>,
    metadata: Option<Meta>,
    spec: Option<PodSpec>,
    status: Option<PodStatus>,
}

/// [`ObjectMeta`]'s fields but `managedFields`, which serde skips as it skips any field it does
/// not name (without building it). Each is moved into [`ObjectMeta`] by `into_object_meta`, whose
/// literal the compiler holds to every field of it; a field of here left out there is dead code.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Meta {
    annotations: Option<BTreeMap<String, String>>,
    creation_timestamp: Option<Time>,
    deletion_grace_period_seconds: Option<i64>,
    deletion_timestamp: Option<Time>,
    finalizers: Option<Vec<String>>,
    generate_name: Option<String>,
    generation: Option<i64>,
    labels: Option<BTreeMap<String, String>>,
    name: Option<String>,
    namespace: Option<String>,
    owner_references: Option<Vec<OwnerReference>>,
    resource_version: Option<String>,
    self_link: Option<String>,
    uid: Option<String>,
}

impl Meta {
    fn into_object_meta(self) -> ObjectMeta {
        ObjectMeta {
            annotations: self.annotations,
            creation_timestamp: self.creation_timestamp,
            deletion_grace_period_seconds: self.deletion_grace_period_seconds,
            deletion_timestamp: self.deletion_timestamp,
            finalizers: self.finalizers,
            generate_name: self.generate_name,
            generation: self.generation,
            labels: self.labels,
            managed_fields: None,
            name: self.name,
            namespace: self.namespace,
            owner_references: self.owner_references,
            resource_version: self.resource_version,
            self_link: self.self_link,
            uid: self.uid,
        }
    }
}

impl<'de> Deserialize<'de> for LeanPod {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use k8s_openapi::Resource as _;
        use serde::de::{Error, Unexpected};
        let wire = Wire::deserialize(deserializer)?;
        for (got, want) in [(&wire.api_version, LeanPod::API_VERSION), (&wire.kind, LeanPod::KIND)] {
            if let Some(got) = got.as_deref().filter(|got| *got != want) {
                return Err(D::Error::invalid_value(Unexpected::Str(got), &want));
            }
        }
        Ok(LeanPod(Pod {
            metadata: wire.metadata.map(Meta::into_object_meta).unwrap_or_default(),
            spec: wire.spec,
            status: wire.status,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pod as a real API server sends it: every metadata field set, managedFields of three
    /// managers, a spec and a status.
    fn full_pod() -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": "job-1-abcde", "generateName": "job-1-", "namespace": "jobs", "uid": "u-1",
                "resourceVersion": "4711", "generation": 1, "selfLink": "/api/v1/namespaces/jobs/pods/job-1-abcde",
                "creationTimestamp": "2026-12-07T04:00:00Z", "deletionTimestamp": "2026-12-07T04:01:00Z",
                "deletionGracePeriodSeconds": 30, "finalizers": ["batch.kubernetes.io/job-tracking"],
                "labels": {"valet.dev/enabled": "true", "job-name": "job-1"},
                "annotations": {"valet.dev/sidecar": "istio-proxy"},
                "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "job-1", "uid": "j-1",
                                     "controller": true, "blockOwnerDeletion": true}],
                "managedFields": [
                    {"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
                     "time": "2026-12-07T04:00:00Z", "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:job-name": {}}},
                                  "f:spec": {"f:containers": {"k:{\"name\":\"app\"}": {".": {}, "f:image": {}}}}}},
                    {"manager": "kubelet", "operation": "Update", "apiVersion": "v1", "subresource": "status",
                     "time": "2026-12-07T04:00:01Z", "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:status": {"f:conditions": {"k:{\"type\":\"Ready\"}": {".": {}, "f:status": {}}},
                                               "f:phase": {}, "f:podIP": {}}}},
                    {"manager": "valet", "operation": "Apply", "apiVersion": "v1", "subresource": "status",
                     "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:status": {"f:conditions": {"k:{\"type\":\"valet.dev/ProxyReady\"}": {}}}}}
                ]
            },
            "spec": {"nodeName": "n1", "containers": [{"name": "app", "image": "app:1"},
                                                      {"name": "istio-proxy", "image": "proxy:1"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.7",
                       "conditions": [{"type": "Ready", "status": "False"}],
                       "containerStatuses": [{"name": "app", "ready": false, "restartCount": 0, "image": "app:1",
                                              "imageID": "", "containerID": "containerd://abc",
                                              "state": {"running": {"startedAt": "2026-12-07T04:00:01Z"}}}]}
        })
    }

    /// Every field of a pod comes through as [`Pod`]'s own deserializer reads it, but its
    /// managedFields; a field of [`ObjectMeta`] forgotten in [`Meta`] fails here.
    #[test]
    fn a_lean_pod_is_the_pod_without_its_managed_fields() {
        let json = full_pod();
        let mut want: Pod = serde_json::from_value(json.clone()).expect("a pod");
        assert!(want.metadata.managed_fields.as_ref().is_some_and(|m| m.len() == 3));
        want.metadata.managed_fields = None;
        let lean: LeanPod = serde_json::from_value(json.clone()).expect("a lean pod");
        assert_eq!(lean.into_pod(), want);
        // From bytes too, as the watch reads them.
        let lean: LeanPod = serde_json::from_slice(&serde_json::to_vec(&json).expect("json")).expect("a lean pod");
        assert_eq!(lean.0, want);
        // The pod above sets each of ObjectMeta's 15 fields (a name misspelt in it would be
        // dropped by both readers alike), so that each must come through.
        let meta = serde_json::to_value(&want.metadata).expect("json");
        assert_eq!(meta.as_object().expect("an object").len(), 14, "all but managedFields: {meta}");
    }

    #[test]
    fn a_lean_pod_without_metadata_or_type_fields_is_read_as_pod_reads_it() {
        for json in [
            serde_json::json!({}),
            serde_json::json!({"metadata": null}),
            serde_json::json!({"metadata": {"name": "p"}}),
        ] {
            let want: Pod = serde_json::from_value(json.clone()).expect("a pod");
            let lean: LeanPod = serde_json::from_value(json.clone()).expect("a lean pod");
            assert_eq!(lean.0, want, "{json}");
        }
    }

    #[test]
    fn another_kind_or_api_version_is_refused_as_pod_refuses_it() {
        for json in [
            serde_json::json!({"kind": "Service", "apiVersion": "v1", "metadata": {"name": "p"}}),
            serde_json::json!({"kind": "Pod", "apiVersion": "v2", "metadata": {"name": "p"}}),
        ] {
            assert!(serde_json::from_value::<Pod>(json.clone()).is_err(), "{json}");
            let err = serde_json::from_value::<LeanPod>(json.clone()).expect_err("refused");
            assert!(err.to_string().contains("invalid value"), "{err}");
        }
    }

    /// Malformed managedFields do not fail the pod: the agent never reads them.
    #[test]
    fn malformed_managed_fields_are_skipped_unread() {
        let json = serde_json::json!({"metadata": {"name": "p", "managedFields": "not a list"}});
        let lean: LeanPod = serde_json::from_value(json).expect("a lean pod");
        assert_eq!(lean.0.metadata.name.as_deref(), Some("p"));
    }
}
