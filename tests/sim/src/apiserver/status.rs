//! `metav1.Status` failures, shaped like the real server's.

use serde_json::{Value, json};

/// An API failure: HTTP code, `reason`, message and optional `details`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub code: u16,
    pub reason: String,
    pub message: String,
    pub details: Option<Value>,
}

impl ApiError {
    pub fn new(code: u16, reason: &str, message: impl Into<String>) -> ApiError {
        ApiError { code, reason: reason.to_string(), message: message.into(), details: None }
    }

    pub fn with_details(mut self, details: Value) -> ApiError {
        self.details = Some(details);
        self
    }

    /// `pods "x" not found`
    pub fn not_found(resource: &str, name: &str) -> ApiError {
        ApiError::new(404, "NotFound", format!("{resource} \"{name}\" not found"))
            .with_details(json!({"name": name, "kind": resource}))
    }

    /// The generic 404 for a path the server does not serve.
    pub fn no_route() -> ApiError {
        ApiError::new(404, "NotFound", "the server could not find the requested resource").with_details(json!({}))
    }

    pub fn already_exists(resource: &str, name: &str) -> ApiError {
        ApiError::new(409, "AlreadyExists", format!("{resource} \"{name}\" already exists"))
            .with_details(json!({"name": name, "kind": resource}))
    }

    pub fn conflict(resource: &str, name: &str) -> ApiError {
        ApiError::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {resource} \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
            ),
        )
        .with_details(json!({"name": name, "kind": resource}))
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "BadRequest", message)
    }

    pub fn invalid(kind: &str, name: &str, message: impl Into<String>) -> ApiError {
        let message = message.into();
        ApiError::new(422, "Invalid", format!("{kind} \"{name}\" is invalid: {message}"))
            .with_details(json!({"name": name, "kind": kind}))
    }

    pub fn method_not_allowed() -> ApiError {
        ApiError::new(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
            .with_details(json!({}))
    }

    /// 410 for a watch or list from a compacted resourceVersion.
    pub fn expired(message: impl Into<String>) -> ApiError {
        ApiError::new(410, "Expired", message)
    }

    /// The error a test asked for with `fail_next`, with the reason the code usually carries.
    pub fn injected(code: u16) -> ApiError {
        let (reason, message) = match code {
            400 => ("BadRequest", "injected bad request"),
            401 => ("Unauthorized", "Unauthorized"),
            403 => ("Forbidden", "forbidden: injected by the test"),
            404 => ("NotFound", "the server could not find the requested resource"),
            409 => ("Conflict", "injected conflict"),
            410 => ("Expired", "injected expiry"),
            422 => ("Invalid", "injected invalid"),
            429 => ("TooManyRequests", "the server has received too many requests and has asked us to try again later"),
            500 => ("InternalError", "Internal error occurred: injected by the test"),
            503 => ("ServiceUnavailable", "the server is currently unable to handle the request"),
            504 => ("Timeout", "the server was unable to return a response in the time allotted"),
            _ => ("", "injected failure"),
        };
        ApiError::new(code, reason, message)
    }

    /// A refusal of [`crate::apiserver::Fault::Status`], worded as the real server words it:
    /// 429 as API Priority and Fairness rejects (with `retryAfterSeconds`, and the
    /// `Retry-After` header the HTTP layer adds), 500 as a storage timeout surfaces.
    pub fn fault(code: u16) -> ApiError {
        match code {
            429 => ApiError::new(429, "TooManyRequests", "Too many requests, please try again later.")
                .with_details(json!({"retryAfterSeconds": 1})),
            500 => ApiError::new(500, "InternalError", "Internal error occurred: etcdserver: request timed out")
                .with_details(json!({"causes": [{"message": "etcdserver: request timed out"}]})),
            _ => ApiError::injected(code),
        }
    }

    /// The Status object as JSON.
    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if self.reason.is_empty()
            && let Some(m) = s.as_object_mut()
        {
            m.remove("reason");
        }
        if let (Some(d), Some(m)) = (&self.details, s.as_object_mut()) {
            m.insert("details".into(), d.clone());
        }
        s
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}
