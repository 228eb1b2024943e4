//! The console's pages: one HTML file, one script and one style sheet,
//! written by hand (no framework, no build step, nothing fetched from the
//! internet) and compiled into the binary. A strict content security
//! policy allows only these three: no inline script, no other origin.

use axum::{
    http::header::{
        CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, REFERRER_POLICY, X_CONTENT_TYPE_OPTIONS,
        X_FRAME_OPTIONS,
    },
    response::IntoResponse,
};

const INDEX: &str = include_str!("pages/index.html");
const SCRIPT: &str = include_str!("pages/app.js");
const STYLE: &str = include_str!("pages/style.css");

const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                      connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn page(kind: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (CONTENT_TYPE, kind),
            (CONTENT_SECURITY_POLICY, POLICY),
            (X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (X_FRAME_OPTIONS, "DENY"),
            (REFERRER_POLICY, "no-referrer"),
            (CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
}

/// `GET /`
pub(super) async fn index() -> impl IntoResponse {
    page("text/html; charset=utf-8", INDEX)
}

/// `GET /app.js`
pub(super) async fn script() -> impl IntoResponse {
    page("text/javascript; charset=utf-8", SCRIPT)
}

/// `GET /style.css`
pub(super) async fn style() -> impl IntoResponse {
    page("text/css; charset=utf-8", STYLE)
}
