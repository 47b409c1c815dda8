//! Label and field selectors with the API server's grammar and matching rules.

use serde_json::Value;

/// One label requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabelOp {
    /// `k=v` or `k==v`
    Equals(String),
    /// `k!=v` (also matches objects without the label)
    NotEquals(String),
    /// `k in (a,b)`
    In(Vec<String>),
    /// `k notin (a,b)` (also matches objects without the label)
    NotIn(Vec<String>),
    /// `k`
    Exists,
    /// `!k`
    DoesNotExist,
    /// `k > n`
    Gt(i64),
    /// `k < n`
    Lt(i64),
}

/// `key op`
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelRequirement {
    pub key: String,
    pub op: LabelOp,
}

/// A parsed `labelSelector`: every requirement must hold (comma = AND).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    pub requirements: Vec<LabelRequirement>,
}

impl LabelSelector {
    /// Parses the query-string form (`a=b,c!=d,e,!f,g in (x,y)`).
    pub fn parse(s: &str) -> Result<LabelSelector, String> {
        let mut requirements = Vec::new();
        for term in split_outside_parens(s) {
            let term = term.trim();
            if term.is_empty() {
                if s.trim().is_empty() {
                    continue;
                }
                return Err(format!("unable to parse requirement: found '', expected: identifier (selector {s:?})"));
            }
            requirements.push(parse_label_term(term)?);
        }
        Ok(LabelSelector { requirements })
    }

    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    /// Whether an object's `metadata.labels` satisfy the selector.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels").and_then(Value::as_object);
        self.requirements.iter().all(|r| {
            let v = labels.and_then(|l| l.get(&r.key)).and_then(Value::as_str);
            match &r.op {
                LabelOp::Equals(want) => v == Some(want.as_str()),
                LabelOp::NotEquals(want) => v != Some(want.as_str()),
                LabelOp::In(set) => v.is_some_and(|v| set.iter().any(|s| s == v)),
                LabelOp::NotIn(set) => !v.is_some_and(|v| set.iter().any(|s| s == v)),
                LabelOp::Exists => v.is_some(),
                LabelOp::DoesNotExist => v.is_none(),
                LabelOp::Gt(n) => v.and_then(|v| v.parse::<i64>().ok()).is_some_and(|x| x > *n),
                LabelOp::Lt(n) => v.and_then(|v| v.parse::<i64>().ok()).is_some_and(|x| x < *n),
            }
        })
    }
}

/// Splits on commas that are not inside `( … )` (set-based values contain commas).
fn split_outside_parens(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn valid_label_key(k: &str) -> bool {
    // prefix/name with the usual label characters; enough to reject garbage like `a b` or `=x`.
    !k.is_empty()
        && k.len() <= 317
        && k.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
        && !k.starts_with('/')
        && !k.ends_with('/')
}

fn valid_label_value(v: &str) -> bool {
    v.len() <= 63 && v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn parse_label_term(term: &str) -> Result<LabelRequirement, String> {
    let bad = |why: &str| format!("unable to parse requirement: {why}: {term:?}");
    if let Some(key) = term.strip_prefix('!') {
        let key = key.trim();
        if !valid_label_key(key) {
            return Err(bad("invalid label key"));
        }
        return Ok(LabelRequirement { key: key.to_string(), op: LabelOp::DoesNotExist });
    }
    // Order matters: `!=` and `==` before `=`.
    for (sym, kind) in [("!=", 0), ("==", 1), ("=", 1), (">", 2), ("<", 3)] {
        if let Some(pos) = term.find(sym) {
            let key = term[..pos].trim();
            let value = term[pos + sym.len()..].trim();
            if !valid_label_key(key) {
                return Err(bad("invalid label key"));
            }
            let op = match kind {
                0 | 1 => {
                    if !valid_label_value(value) {
                        return Err(bad("invalid label value"));
                    }
                    if kind == 0 { LabelOp::NotEquals(value.to_string()) } else { LabelOp::Equals(value.to_string()) }
                }
                2 => LabelOp::Gt(
                    value.parse().map_err(|_| bad("for 'Gt', 'Lt' operators, the value must be an integer"))?,
                ),
                _ => LabelOp::Lt(
                    value.parse().map_err(|_| bad("for 'Gt', 'Lt' operators, the value must be an integer"))?,
                ),
            };
            return Ok(LabelRequirement { key: key.to_string(), op });
        }
    }
    // Set-based: `key in (a,b)` / `key notin (a,b)`.
    let words: Vec<&str> = term.splitn(2, char::is_whitespace).collect();
    if words.len() == 2 {
        let key = words[0].trim();
        let rest = words[1].trim();
        let (negate, list) = if let Some(l) = rest.strip_prefix("notin") {
            (true, l)
        } else if let Some(l) = rest.strip_prefix("in") {
            (false, l)
        } else {
            return Err(bad("expected one of ['in', 'notin', '=', '==', '!=', 'gt', 'lt']"));
        };
        let list = list.trim();
        let inner = list
            .strip_prefix('(')
            .and_then(|l| l.strip_suffix(')'))
            .ok_or_else(|| bad("expected a parenthesised list of values"))?;
        let values: Vec<String> = inner.split(',').map(|v| v.trim().to_string()).collect();
        if !valid_label_key(key) || values.iter().any(|v| !valid_label_value(v)) {
            return Err(bad("invalid key or value"));
        }
        let op = if negate { LabelOp::NotIn(values) } else { LabelOp::In(values) };
        return Ok(LabelRequirement { key: key.to_string(), op });
    }
    if !valid_label_key(term) {
        return Err(bad("invalid label key"));
    }
    Ok(LabelRequirement { key: term.to_string(), op: LabelOp::Exists })
}

/// One `field=value` / `field!=value` term.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldRequirement {
    pub field: String,
    pub value: String,
    pub negate: bool,
}

/// A parsed `fieldSelector` (comma = AND).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector {
    pub requirements: Vec<FieldRequirement>,
}

/// Which object kind a field selector is evaluated against (each has its own field set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldKind {
    Pod,
    Event,
}

/// Fields the real server accepts in pod field selectors.
pub const POD_FIELDS: &[&str] = &[
    "metadata.name",
    "metadata.namespace",
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
];

/// Fields the real server accepts in event field selectors (core/v1 names).
pub const EVENT_FIELDS: &[&str] = &[
    "metadata.name",
    "metadata.namespace",
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
];

impl FieldSelector {
    /// Parses `a=b,c!=d` (backslash escapes `\,` `\=` `\\` like apimachinery's `fields`).
    pub fn parse(s: &str) -> Result<FieldSelector, String> {
        let mut requirements = Vec::new();
        if s.trim().is_empty() {
            return Ok(FieldSelector { requirements });
        }
        for term in split_unescaped(s, ',') {
            let (field, value, negate) = if let Some(p) = find_unescaped(&term, "!=") {
                (&term[..p], &term[p + 2..], true)
            } else if let Some(p) = find_unescaped(&term, "==") {
                (&term[..p], &term[p + 2..], false)
            } else if let Some(p) = find_unescaped(&term, "=") {
                (&term[..p], &term[p + 1..], false)
            } else {
                return Err(format!("invalid selector: '{s}'; can't understand '{term}'"));
            };
            requirements.push(FieldRequirement { field: field.trim().to_string(), value: unescape(value), negate });
        }
        Ok(FieldSelector { requirements })
    }

    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    /// Rejects fields the real server does not index for that kind.
    pub fn validate(&self, kind: FieldKind) -> Result<(), String> {
        let allowed = match kind {
            FieldKind::Pod => POD_FIELDS,
            FieldKind::Event => EVENT_FIELDS,
        };
        for r in &self.requirements {
            if !allowed.contains(&r.field.as_str()) {
                return Err(format!("field label not supported: {}", r.field));
            }
        }
        Ok(())
    }

    pub fn matches(&self, obj: &Value, kind: FieldKind) -> bool {
        self.requirements.iter().all(|r| {
            let actual = field_value(obj, &r.field, kind);
            (actual == r.value) != r.negate
        })
    }
}

/// The string the server compares for `field`; absent fields read as "" (so `spec.nodeName=`
/// selects unscheduled pods), booleans as "true"/"false".
pub fn field_value(obj: &Value, field: &str, kind: FieldKind) -> String {
    let path = match (kind, field) {
        (FieldKind::Event, "source") => "/source/component".to_string(),
        (FieldKind::Event, "reportingComponent") => "/reportingComponent".to_string(),
        _ => format!("/{}", field.replace('.', "/")),
    };
    let mut v = obj.pointer(&path);
    // events.k8s.io/v1 objects name these fields differently; the server indexes both.
    if v.is_none() && kind == FieldKind::Event {
        let alt = match field {
            "involvedObject.kind" => Some("/regarding/kind"),
            "involvedObject.namespace" => Some("/regarding/namespace"),
            "involvedObject.name" => Some("/regarding/name"),
            "involvedObject.uid" => Some("/regarding/uid"),
            "involvedObject.apiVersion" => Some("/regarding/apiVersion"),
            "involvedObject.resourceVersion" => Some("/regarding/resourceVersion"),
            "involvedObject.fieldPath" => Some("/regarding/fieldPath"),
            "reportingComponent" => Some("/reportingController"),
            "source" => Some("/deprecatedSource/component"),
            _ => None,
        };
        v = alt.and_then(|p| obj.pointer(p));
    }
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => b.to_string(),
        Some(Value::Number(n)) => n.to_string(),
        None | Some(Value::Null) => {
            if field == "spec.hostNetwork" {
                "false".into()
            } else {
                String::new()
            }
        }
        Some(other) => other.to_string(),
    }
}

fn split_unescaped(s: &str, sep: char) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut escaped = false;
    for c in s.chars() {
        if escaped {
            cur.push('\\');
            cur.push(c);
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == sep {
            out.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    out.push(cur);
    out
}

fn find_unescaped(s: &str, pat: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            i += 2;
            continue;
        }
        if s[i..].starts_with(pat) {
            return Some(i);
        }
        i += 1;
    }
    None
}

fn unescape(s: &str) -> String {
    let mut out = String::new();
    let mut escaped = false;
    for c in s.chars() {
        if escaped {
            out.push(c);
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(labels: Value) -> Value {
        json!({"metadata": {"name": "p", "namespace": "ns", "labels": labels},
               "spec": {"nodeName": "node-a"}, "status": {"phase": "Running"}})
    }

    #[test]
    fn label_equality_and_existence() {
        let p = pod(json!({"app": "web", "tier": "fe"}));
        let cases = [
            ("app=web", true),
            ("app==web", true),
            ("app=db", false),
            ("app!=db", true),
            ("missing!=x", true),
            ("app", true),
            ("missing", false),
            ("!missing", true),
            ("!app", false),
            ("app=web,tier=fe", true),
            ("app=web,tier=be", false),
            ("app in (db,web)", true),
            ("app notin (db,web)", false),
            ("missing notin (x)", true),
            ("app in (db, web),tier", true),
            ("", true),
        ];
        for (sel, want) in cases {
            let s = LabelSelector::parse(sel).expect("valid selector");
            assert_eq!(s.matches(&p), want, "{sel}");
        }
    }

    #[test]
    fn label_parse_errors() {
        for bad in ["=x", "a b", "a in x", "a,,b", "a=b c"] {
            assert!(LabelSelector::parse(bad).is_err(), "{bad} should fail");
        }
    }

    #[test]
    fn gt_lt() {
        let p = pod(json!({"n": "5"}));
        assert!(LabelSelector::parse("n>3").expect("valid").matches(&p));
        assert!(!LabelSelector::parse("n<3").expect("valid").matches(&p));
    }

    #[test]
    fn field_selectors() {
        let p = pod(json!({}));
        let unscheduled = json!({"metadata": {"name": "q", "namespace": "ns"}});
        let cases = [
            ("spec.nodeName=node-a", true),
            ("spec.nodeName==node-a", true),
            ("spec.nodeName!=node-a", false),
            ("metadata.name=p,metadata.namespace=ns", true),
            ("metadata.namespace=other", false),
            ("status.phase=Running", true),
            ("status.phase!=Succeeded", true),
            ("spec.hostNetwork=false", true),
        ];
        for (sel, want) in cases {
            let s = FieldSelector::parse(sel).expect("valid selector");
            s.validate(FieldKind::Pod).expect("supported");
            assert_eq!(s.matches(&p, FieldKind::Pod), want, "{sel}");
        }
        let s = FieldSelector::parse("spec.nodeName=").expect("valid selector");
        assert!(s.matches(&unscheduled, FieldKind::Pod));
        assert!(!s.matches(&p, FieldKind::Pod));
    }

    #[test]
    fn field_selector_errors() {
        assert!(FieldSelector::parse("nonsense").is_err());
        let s = FieldSelector::parse("spec.foo=bar").expect("parses");
        assert_eq!(s.validate(FieldKind::Pod), Err("field label not supported: spec.foo".into()));
    }

    #[test]
    fn field_escapes() {
        let s = FieldSelector::parse(r"metadata.name=a\,b").expect("parses");
        assert_eq!(s.requirements[0].value, "a,b");
    }

    #[test]
    fn event_fields_both_groups() {
        let core = json!({"involvedObject": {"name": "p"}, "source": {"component": "valet"}});
        let new = json!({"regarding": {"name": "p"}, "reportingController": "valet"});
        let s = FieldSelector::parse("involvedObject.name=p").expect("parses");
        assert!(s.matches(&core, FieldKind::Event));
        assert!(s.matches(&new, FieldKind::Event));
        let s = FieldSelector::parse("reportingComponent=valet").expect("parses");
        assert!(s.matches(&new, FieldKind::Event));
    }
}
