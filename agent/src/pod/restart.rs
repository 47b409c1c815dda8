//! Whether the kubelet restarts a container that exited: the pod's `restartPolicy`, the
//! container's own `restartPolicy` and its `restartPolicyRules` (KEP-5307, `ContainerRestartRules`:
//! alpha 1.34, beta and on by default from 1.35), and the `RestartAllContainers` action (KEP-5532,
//! alpha 1.35, beta 1.36).
//!
//! Written from the kubelet's code (`pkg/api/v1/pod/util.go`: `ContainerShouldRestart` and
//! `findMatchingContainerRestartRule`; `pkg/kubelet/container/helpers.go`:
//! `ShouldContainerBeRestarted`, its caller in `computePodActions`):
//!
//! 1. A container with its own `restartPolicy` has its `restartPolicyRules` checked in order; the
//!    first rule whose `exitCodes` requirement holds decides (`In`: the code is among the values;
//!    `NotIn`: it is not). Its action `Restart` restarts the container; `RestartAllContainers`
//!    restarts every container of the pod in place, init containers and sidecars included.
//! 2. No rule matches (or there are none): the container's `restartPolicy` decides (`Always`:
//!    restart; `OnFailure`: restart unless the code is 0; `Never`: no restart).
//! 3. A container without its own `restartPolicy`: the pod's decides, the same way.
//!
//! The exit code is the runtime's: a process killed by signal `n` exits `128 + n` there.
//!
//! Where the kubelet meets an operator or action it does not know, it skips the rule or does not
//! restart; a newer kubelet may know it. valet never guesses: an exit that such a rule could
//! decide is [`AfterExit::Unsure`], and the pod's end is left to the kubelet.

use k8s_openapi::api::core::v1::{Container, ContainerRestartRule};

/// How a container's main process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExitOutcome {
    /// Exited with this status (the API's `exitCode`; 137 there usually means SIGKILL).
    Code(i32),
    /// Killed by this signal (seen by the kernel path before the runtime turns it into 128+n).
    Signal(i32),
    /// Ended, but how is not known (an exit code the kernel could not read, an end no agent saw):
    /// never a success, and the API's code replaces it once the kubelet reports it.
    Unknown,
}

impl ExitOutcome {
    /// Only a clean `exit(0)` counts as success.
    pub fn success(&self) -> bool {
        matches!(self, ExitOutcome::Code(0))
    }

    /// The exit code the runtime reports for this end (a signal `n` is `128 + n` there), which
    /// is what the kubelet's restart rules see.
    pub fn code(&self) -> Option<i32> {
        match *self {
            ExitOutcome::Code(code) => Some(code),
            ExitOutcome::Signal(signal) => Some(128 + signal),
            ExitOutcome::Unknown => None,
        }
    }
}

/// A restart policy: the pod's `spec.restartPolicy` or a container's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RestartPolicy {
    Never,
    OnFailure,
    /// Also when the pod's field is absent, as in Kubernetes.
    Always,
}

impl RestartPolicy {
    /// The policy named `text`, if it is one.
    pub fn parse(text: &str) -> Option<RestartPolicy> {
        match text {
            "Never" => Some(RestartPolicy::Never),
            "OnFailure" => Some(RestartPolicy::OnFailure),
            "Always" => Some(RestartPolicy::Always),
            _ => None,
        }
    }

    fn restarts(self, code: i32) -> bool {
        match self {
            RestartPolicy::Never => false,
            RestartPolicy::OnFailure => code != 0,
            RestartPolicy::Always => true,
        }
    }
}

/// What a rule asks for when it matches.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RuleAction {
    /// `Restart`: the container alone, in place.
    Restart,
    /// `RestartAllContainers`: every container of the pod, in place.
    RestartAllContainers,
    /// An action this agent does not know (a newer API's).
    Unknown(String),
}

/// How a rule compares the exit code with its values.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CodeOperator {
    In,
    NotIn,
    /// An operator this agent does not know (a newer API's).
    Unknown(String),
}

/// One entry of a container's `restartPolicyRules`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RestartRule {
    pub action: RuleAction,
    /// The `exitCodes` requirement; `None`: the rule has none (a newer API's matcher, perhaps),
    /// and the kubelet this was written from never matches it.
    pub exit_codes: Option<(CodeOperator, Vec<i32>)>,
}

/// A container's own restart settings, when it has a `restartPolicy` of its own.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ContainerRestart {
    pub policy: RestartPolicy,
    pub rules: Vec<RestartRule>,
}

/// What the kubelet does after a container's exit.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AfterExit {
    /// Nothing: the container stays exited.
    Stays,
    /// It restarts the container in place (a new instance, with a new id).
    Restart,
    /// It restarts every container of the pod in place.
    RestartAll,
    /// valet cannot tell: a rule it does not understand may decide this exit (the reason says which).
    Unsure(String),
}

impl AfterExit {
    /// Whether the container stays exited for good.
    pub fn stays(&self) -> bool {
        matches!(self, AfterExit::Stays)
    }
}

/// A container's own restart settings (`None`: it has no `restartPolicy` of its own, and the
/// pod's applies), or why they cannot be read.
pub fn container_restart(c: &Container) -> Result<Option<ContainerRestart>, String> {
    let Some(policy) = c.restart_policy.as_deref() else {
        // The API server refuses rules without a container restartPolicy; one that took them
        // anyway is judged by the pod's policy, as the kubelet does.
        return Ok(None);
    };
    let policy = RestartPolicy::parse(policy)
        .ok_or_else(|| format!("container {:?}: unknown restartPolicy {policy:?}", c.name))?;
    let rules = c.restart_policy_rules.as_deref().unwrap_or_default().iter().map(rule).collect();
    Ok(Some(ContainerRestart { policy, rules }))
}

fn rule(r: &ContainerRestartRule) -> RestartRule {
    let action = match r.action.as_str() {
        "Restart" => RuleAction::Restart,
        "RestartAllContainers" => RuleAction::RestartAllContainers,
        other => RuleAction::Unknown(other.to_owned()),
    };
    let exit_codes = r.exit_codes.as_ref().map(|e| {
        let op = match e.operator.as_str() {
            "In" => CodeOperator::In,
            "NotIn" => CodeOperator::NotIn,
            other => CodeOperator::Unknown(other.to_owned()),
        };
        (op, e.values.clone().unwrap_or_default())
    });
    RestartRule { action, exit_codes }
}

/// What the kubelet does after a container with these settings exits with `code` (`None`: the
/// code is not known yet, as for a container that ended while no agent watched).
pub fn after_exit(pod_policy: RestartPolicy, own: Option<&ContainerRestart>, code: Option<i32>) -> AfterExit {
    let Some(own) = own else {
        return policy_after(pod_policy, code);
    };
    for (i, r) in own.rules.iter().enumerate() {
        let Some((op, values)) = &r.exit_codes else { continue };
        let matched = match (op, code) {
            (CodeOperator::Unknown(op), _) => {
                return AfterExit::Unsure(format!("restartPolicyRules[{i}] has the unknown operator {op:?}"));
            }
            (_, None) => return AfterExit::Unsure("the exit code is not known yet".into()),
            (CodeOperator::In, Some(code)) => values.contains(&code),
            (CodeOperator::NotIn, Some(code)) => !values.contains(&code),
        };
        if matched {
            return match &r.action {
                RuleAction::Restart => AfterExit::Restart,
                RuleAction::RestartAllContainers => AfterExit::RestartAll,
                RuleAction::Unknown(a) => {
                    AfterExit::Unsure(format!("restartPolicyRules[{i}] has the unknown action {a:?}"))
                }
            };
        }
    }
    policy_after(own.policy, code)
}

fn policy_after(policy: RestartPolicy, code: Option<i32>) -> AfterExit {
    match (policy, code) {
        (RestartPolicy::Never, _) => AfterExit::Stays,
        (RestartPolicy::Always, _) => AfterExit::Restart,
        (RestartPolicy::OnFailure, None) => AfterExit::Unsure("the exit code is not known yet".into()),
        (policy, Some(code)) if policy.restarts(code) => AfterExit::Restart,
        (_, Some(_)) => AfterExit::Stays,
    }
}

/// Whether any exit could restart the container (its settings name a restart anywhere).
pub fn may_restart(pod_policy: RestartPolicy, own: Option<&ContainerRestart>) -> bool {
    match own {
        None => pod_policy != RestartPolicy::Never,
        Some(own) => own.policy != RestartPolicy::Never || !own.rules.is_empty(),
    }
}

/// Whether every exit restarts the container: it never ends for good.
pub fn always_restarts(pod_policy: RestartPolicy, own: Option<&ContainerRestart>) -> bool {
    match own {
        None => pod_policy == RestartPolicy::Always,
        // A rule may still stop it (an unknown action): only a rule-less Always is certain.
        Some(own) => own.policy == RestartPolicy::Always && own.rules.iter().all(|r| r.action == RuleAction::Restart),
    }
}

/// The unknown operators and actions of a container's rules, for the pod's Warning Event.
pub fn unknown_parts(own: &ContainerRestart) -> Vec<String> {
    let mut out = Vec::new();
    for (i, r) in own.rules.iter().enumerate() {
        if let RuleAction::Unknown(a) = &r.action {
            out.push(format!("restartPolicyRules[{i}].action {a:?}"));
        }
        if let Some((CodeOperator::Unknown(op), _)) = &r.exit_codes {
            out.push(format!("restartPolicyRules[{i}].exitCodes.operator {op:?}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn own(v: serde_json::Value) -> Option<ContainerRestart> {
        let mut c = json!({"name": "app", "image": "busybox"});
        c.as_object_mut().expect("object").extend(v.as_object().expect("object").clone());
        let c: Container = serde_json::from_value(c).expect("container");
        container_restart(&c).expect("settings")
    }

    fn rule(action: &str, op: &str, values: &[i32]) -> serde_json::Value {
        json!({"action": action, "exitCodes": {"operator": op, "values": values}})
    }

    use RestartPolicy::{Always, Never, OnFailure};

    #[test]
    fn without_settings_of_its_own_the_pods_policy_decides() {
        for code in [0, 1, 42, 137] {
            assert_eq!(after_exit(Never, None, Some(code)), AfterExit::Stays);
            assert_eq!(after_exit(Always, None, Some(code)), AfterExit::Restart);
        }
        assert_eq!(after_exit(OnFailure, None, Some(0)), AfterExit::Stays);
        assert_eq!(after_exit(OnFailure, None, Some(1)), AfterExit::Restart);
        assert!(matches!(after_exit(OnFailure, None, None), AfterExit::Unsure(_)));
        assert_eq!(after_exit(Never, None, None), AfterExit::Stays);
    }

    #[test]
    fn the_containers_policy_overrides_the_pods() {
        let on_failure = own(json!({"restartPolicy": "OnFailure"}));
        assert_eq!(after_exit(Never, on_failure.as_ref(), Some(1)), AfterExit::Restart);
        assert_eq!(after_exit(Never, on_failure.as_ref(), Some(0)), AfterExit::Stays);
        let never = own(json!({"restartPolicy": "Never"}));
        assert_eq!(after_exit(Always, never.as_ref(), Some(1)), AfterExit::Stays);
        assert!(!may_restart(Always, never.as_ref()));
        assert!(may_restart(Never, on_failure.as_ref()));
    }

    #[test]
    fn in_restarts_only_the_listed_codes() {
        let s = own(json!({"restartPolicy": "Never", "restartPolicyRules": [rule("Restart", "In", &[42])]}));
        assert_eq!(after_exit(Never, s.as_ref(), Some(42)), AfterExit::Restart);
        for code in [0, 1, 41, 43, 137] {
            assert_eq!(after_exit(Never, s.as_ref(), Some(code)), AfterExit::Stays, "code {code}");
        }
    }

    #[test]
    fn not_in_restarts_every_other_code() {
        let s = own(json!({"restartPolicy": "Never", "restartPolicyRules": [rule("Restart", "NotIn", &[0, 3])]}));
        assert_eq!(after_exit(Never, s.as_ref(), Some(0)), AfterExit::Stays);
        assert_eq!(after_exit(Never, s.as_ref(), Some(3)), AfterExit::Stays);
        assert_eq!(after_exit(Never, s.as_ref(), Some(1)), AfterExit::Restart);
        assert_eq!(after_exit(Never, s.as_ref(), Some(143)), AfterExit::Restart);
    }

    #[test]
    fn the_first_matching_rule_wins_and_no_match_falls_to_the_containers_policy() {
        let s = own(json!({"restartPolicy": "OnFailure", "restartPolicyRules": [
            rule("RestartAllContainers", "In", &[7]),
            rule("Restart", "In", &[7, 8]),
            rule("Restart", "NotIn", &[0, 1, 7, 8]),
        ]}));
        assert_eq!(after_exit(Never, s.as_ref(), Some(7)), AfterExit::RestartAll);
        assert_eq!(after_exit(Never, s.as_ref(), Some(8)), AfterExit::Restart);
        assert_eq!(after_exit(Never, s.as_ref(), Some(9)), AfterExit::Restart);
        // No rule matches: the container's OnFailure, not the pod's Never.
        assert_eq!(after_exit(Never, s.as_ref(), Some(1)), AfterExit::Restart);
        assert_eq!(after_exit(Never, s.as_ref(), Some(0)), AfterExit::Stays);
    }

    #[test]
    fn restart_all_containers_is_its_own_outcome() {
        let s =
            own(json!({"restartPolicy": "Never", "restartPolicyRules": [rule("RestartAllContainers", "In", &[42])]}));
        assert_eq!(after_exit(Never, s.as_ref(), Some(42)), AfterExit::RestartAll);
        assert_eq!(after_exit(Never, s.as_ref(), Some(0)), AfterExit::Stays);
        assert!(!AfterExit::RestartAll.stays());
    }

    #[test]
    fn an_unknown_action_or_operator_is_unsure_where_it_could_decide_and_nowhere_else() {
        let s = own(json!({"restartPolicy": "Never", "restartPolicyRules": [
            rule("Restart", "In", &[1]),
            rule("RestartPodSandbox", "In", &[2]),
        ]}));
        // An earlier known rule decides first.
        assert_eq!(after_exit(Never, s.as_ref(), Some(1)), AfterExit::Restart);
        assert!(
            matches!(after_exit(Never, s.as_ref(), Some(2)), AfterExit::Unsure(why) if why.contains("RestartPodSandbox"))
        );
        // The unknown action's rule does not match: the policy decides.
        assert_eq!(after_exit(Never, s.as_ref(), Some(0)), AfterExit::Stays);
        let settings = s.as_ref().expect("settings");
        assert_eq!(unknown_parts(settings), vec!["restartPolicyRules[1].action \"RestartPodSandbox\"".to_owned()]);

        let op = own(json!({"restartPolicy": "Never", "restartPolicyRules": [rule("Restart", "GreaterThan", &[0])]}));
        assert!(
            matches!(after_exit(Never, op.as_ref(), Some(0)), AfterExit::Unsure(why) if why.contains("GreaterThan"))
        );
        assert!(matches!(after_exit(Never, op.as_ref(), Some(5)), AfterExit::Unsure(_)));
    }

    #[test]
    fn an_unknown_exit_code_is_unsure_only_where_the_code_matters() {
        let s = own(json!({"restartPolicy": "Never", "restartPolicyRules": [rule("Restart", "In", &[42])]}));
        assert!(matches!(after_exit(Never, s.as_ref(), None), AfterExit::Unsure(_)));
        let plain = own(json!({"restartPolicy": "Never"}));
        assert_eq!(after_exit(Always, plain.as_ref(), None), AfterExit::Stays);
    }

    #[test]
    fn a_rule_without_an_exit_code_requirement_never_matches() {
        let s = own(json!({"restartPolicy": "Never", "restartPolicyRules": [{"action": "Restart"}]}));
        assert_eq!(after_exit(Never, s.as_ref(), Some(1)), AfterExit::Stays);
    }

    #[test]
    fn an_unknown_container_policy_is_an_error() {
        let c: Container =
            serde_json::from_value(json!({"name": "app", "restartPolicy": "Sometimes"})).expect("container");
        assert!(container_restart(&c).expect_err("error").contains("Sometimes"));
    }

    #[test]
    fn always_restarts_only_when_no_exit_can_end_it() {
        assert!(always_restarts(Always, None));
        assert!(!always_restarts(Never, None));
        let always = own(json!({"restartPolicy": "Always"}));
        assert!(always_restarts(Never, always.as_ref()));
        let always_but = own(json!({"restartPolicy": "Always", "restartPolicyRules": [rule("Stop", "In", &[0])]}));
        assert!(!always_restarts(Never, always_but.as_ref()));
    }
}
