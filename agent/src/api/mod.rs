//! The Kubernetes API side: the pod watch, Events, and the readiness condition.
pub mod condition;
pub mod events;
pub mod lean_pod;
pub mod runtime_classes;
pub mod successor;
pub mod watch;

use std::time::Duration;

use kube::Client;
use kube::client::ClientBuilder;

/// Most writes to the API server in flight at once (condition patches, Events). Without a bound,
/// a burst of pods (50 Jobs starting in one second) opened a connection per write, and the client
/// keeps idle connections open for 90 s: the agent's fds, and its connections to the API server,
/// followed the largest burst seen. The others wait their turn in the client's queue.
pub const MAX_WRITES_IN_FLIGHT: usize = 4;

/// How long a write may take once sent. kube's client has no read timeout (only a 30 s connect
/// and a 295 s write timeout), so an API server that took a request and never answered held the
/// pod's next condition write, and now would hold a slot, for as long as it hung; a write that
/// fails is retried at the pod's next probe result.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a request of the pod watch (a list, the start of a watch) may take until the API
/// server's answer begins. kube's watcher awaits both without a timeout, and its idle timeout
/// covers only a watch stream that has started: a server that took the request and never
/// answered held the watch, and left new pods unseen, for as long as the connection lived. A
/// watch stream itself is not bounded by this (its body comes after the answer's head).
pub const WATCH_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A service stack a [`ClientBuilder`] can build a client of: kube's bounds on its `build`, named
/// once for the clients below.
pub trait ApiService:
    tower::Service<
        http::Request<kube::client::Body>,
        Response = http::Response<Self::ResponseBody>,
        Error: Into<tower::BoxError>,
        Future: Send + 'static,
    > + Send
    + 'static
{
    type ResponseBody: http_body::Body<Data = bytes::Bytes, Error: Into<tower::BoxError>> + Send + 'static;
}

impl<S, B> ApiService for S
where
    S: tower::Service<http::Request<kube::client::Body>, Response = http::Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<tower::BoxError>,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<tower::BoxError>,
{
    type ResponseBody = B;
}

/// The client the pod watch uses: `builder`'s stack, each request bounded by
/// [`WATCH_REQUEST_TIMEOUT`] until its answer begins.
pub fn watch_client<S: ApiService>(builder: ClientBuilder<S>) -> Client {
    builder.with_layer(&tower::timeout::TimeoutLayer::new(WATCH_REQUEST_TIMEOUT)).build()
}

/// The client the agent writes with: `builder`'s stack with at most [`MAX_WRITES_IN_FLIGHT`]
/// requests in flight, each bounded by [`WRITE_TIMEOUT`] (from when it is sent, not queued). The
/// pod watch has a client of its own, so that writes waiting never delay a re-list.
pub fn writes_client<S: ApiService>(builder: ClientBuilder<S>) -> Client {
    builder
        .with_layer(&tower::timeout::TimeoutLayer::new(WRITE_TIMEOUT))
        .with_layer(&tower::limit::ConcurrencyLimitLayer::new(MAX_WRITES_IN_FLIGHT))
        .build()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Pod;
    use kube::Api;
    use kube::client::Body;

    use super::*;

    type Handle = tower_test::mock::Handle<http::Request<Body>, http::Response<Body>>;
    type Call = (http::Request<Body>, tower_test::mock::SendResponse<http::Response<Body>>);

    /// The next request to reach the server, if one does before the runtime has nothing left to
    /// run: on a paused clock, time moves only then, so the 300 ms are no window a busy machine
    /// can close.
    async fn next(h: &mut Handle) -> Option<Call> {
        tokio::time::timeout(Duration::from_millis(300), h.next_request()).await.ok().flatten()
    }

    #[tokio::test(start_paused = true)]
    async fn at_most_four_writes_are_in_flight() {
        let (service, mut handle) = tower_test::mock::pair::<http::Request<Body>, http::Response<Body>>();
        let client = writes_client(ClientBuilder::new(service, "default"));
        for i in 0..10 {
            let api: Api<Pod> = Api::namespaced(client.clone(), "jobs");
            tokio::spawn(async move { api.get_opt(&format!("job-{i}")).await });
        }
        let mut waiting = Vec::new();
        while let Some(call) = next(&mut handle).await {
            waiting.push(call);
        }
        assert_eq!(waiting.len(), MAX_WRITES_IN_FLIGHT, "requests reaching the server before any answer");
        // One answered: one more goes out; all ten are served in the end.
        let answer = |send: tower_test::mock::SendResponse<http::Response<Body>>| {
            let not_found = br#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}"#;
            let response =
                http::Response::builder().status(404).body(Body::from(not_found.to_vec())).expect("a response");
            send.send_response(response);
        };
        let (_, send) = waiting.remove(0);
        answer(send);
        waiting.push(next(&mut handle).await.expect("a fifth request once one is answered"));
        assert!(next(&mut handle).await.is_none(), "still four in flight");
        let mut served = 1;
        for (_, send) in waiting {
            answer(send);
            served += 1;
        }
        while let Some((_, send)) = next(&mut handle).await {
            answer(send);
            served += 1;
        }
        assert_eq!(served, 10);
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_request_left_unanswered_fails_after_its_timeout_and_an_answered_one_streams_on() {
        use futures::{SinkExt as _, StreamExt as _};
        type Chunks = futures::channel::mpsc::Receiver<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>;
        type Streamed = http_body_util::StreamBody<Chunks>;
        let (service, mut handle) = tower_test::mock::pair::<http::Request<Body>, http::Response<Streamed>>();
        let api: Api<Pod> = Api::all(watch_client(ClientBuilder::new(service, "default")));
        let started = tokio::time::Instant::now();
        let list = tokio::spawn({
            let api = api.clone();
            async move { api.list(&kube::api::ListParams::default()).await }
        });
        let _unanswered = handle.next_request().await.expect("the list is sent");
        let result = list.await.expect("task");
        assert!(result.is_err(), "an unanswered list fails: {result:?}");
        assert!(started.elapsed() >= WATCH_REQUEST_TIMEOUT, "after {:?}", started.elapsed());

        // A watch answered at once streams on for longer than the timeout: a later event comes.
        let watch = tokio::spawn(async move {
            let stream = api.watch(&kube::api::WatchParams::default(), "0").await?;
            let mut stream = std::pin::pin!(stream);
            stream.next().await.transpose()
        });
        let (_, send) = handle.next_request().await.expect("the watch is sent");
        let (mut tx, rx) = futures::channel::mpsc::channel(1);
        send.send_response(
            http::Response::builder().status(200).body(http_body_util::StreamBody::new(rx)).expect("a response"),
        );
        tokio::time::sleep(WATCH_REQUEST_TIMEOUT * 3).await;
        let line = concat!(
            r#"{"type":"ADDED","object":{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p","resourceVersion":"2"}}}"#,
            "\n"
        );
        tx.send(Ok(http_body::Frame::data(bytes::Bytes::from(line)))).await.expect("send a line");
        let event = watch.await.expect("task");
        assert!(matches!(event, Ok(Some(kube::api::WatchEvent::Added(_)))), "{event:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_left_unanswered_fails_after_its_timeout_and_frees_its_slot() {
        let (service, mut handle) = tower_test::mock::pair::<http::Request<Body>, http::Response<Body>>();
        let client = writes_client(ClientBuilder::new(service, "default"));
        let started = tokio::time::Instant::now();
        let mut tasks = Vec::new();
        for i in 0..=MAX_WRITES_IN_FLIGHT {
            let api: Api<Pod> = Api::namespaced(client.clone(), "jobs");
            tasks.push(tokio::spawn(async move { api.get_opt(&format!("job-{i}")).await }));
        }
        let mut sent = Vec::new();
        for _ in 0..MAX_WRITES_IN_FLIGHT {
            sent.push(next(&mut handle).await.expect("a request within the limit"));
        }
        // Nobody answers: the fifth goes out once the first ones time out, not before.
        let fifth = tokio::time::timeout(Duration::from_secs(60), handle.next_request()).await;
        assert!(fifth.ok().flatten().is_some(), "the fifth request went out");
        assert!(started.elapsed() >= WRITE_TIMEOUT, "after {:?}", started.elapsed());
        for task in tasks.drain(..MAX_WRITES_IN_FLIGHT) {
            let result = task.await.expect("task");
            assert!(result.is_err(), "an unanswered request fails: {result:?}");
        }
        drop(sent);
    }
}
