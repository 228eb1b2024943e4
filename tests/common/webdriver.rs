//! A real headless Chromium driven through the W3C WebDriver protocol:
//! Debian's `chromedriver` started on a free loopback port (stopped by PID
//! when dropped), one session, and the few commands the console's tests
//! use (go, find, click, type, read, run a script, screenshot). WebDriver
//! is JSON over HTTP/1.1; each command is one short request.

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command},
    time::{Duration, Instant},
};

use serde_json::{Value, json};

/// The W3C key of an element reference in WebDriver answers.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

fn tool(variable: &str, default: &str) -> PathBuf {
    std::env::var_os(variable).map_or_else(|| PathBuf::from(default), PathBuf::from)
}

/// Chromium under ChromeDriver, one session.
pub struct Browser {
    driver: Option<Child>,
    port: u16,
    session: String,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts ChromeDriver (log in `log`) and a headless Chromium session
    /// with a fresh profile and no background traffic.
    pub fn start(log: &Path) -> Self {
        let driver = tool("RATELIMITD_CHROMEDRIVER", "/usr/bin/chromedriver");
        let chromium = tool("RATELIMITD_CHROMIUM", "/usr/bin/chromium");
        let (child, port) = super::start_listening("chromedriver", log, |port| {
            let mut command = Command::new(&driver);
            command.arg(format!("--port={port}"));
            command
        });
        let profile = tempfile::tempdir().unwrap();
        let args = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1400,1000",
        ];
        let mut args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        args.push(format!("--user-data-dir={}", profile.path().display()));
        let mut browser = Browser { driver: Some(child), port, session: String::new(), _profile: profile };
        let capabilities = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": { "binary": chromium, "args": args },
        }}});
        let answer = browser.call("POST", "/session", Some(&capabilities));
        browser.session = answer["sessionId"].as_str().expect("a session id").to_owned();
        browser
    }

    /// One WebDriver command; its `value`. Panics on a WebDriver error.
    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        let (head, value) =
            self.exchange(method, path, body).unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e}"));
        assert!(head.starts_with("HTTP/1.1 200"), "WebDriver {method} {path}: {head}\n{value}");
        value["value"].clone()
    }

    /// [`Browser::call`] without a body, `None` on any error (never panics:
    /// it also ends the session while a failed test unwinds).
    fn try_call(&self, method: &str, path: &str) -> Option<Value> {
        let (head, value) = self.exchange(method, path, None).ok()?;
        head.starts_with("HTTP/1.1 200").then(|| value["value"].clone())
    }

    /// One request and its answer: the status line and headers, the JSON.
    fn exchange(&self, method: &str, path: &str, body: Option<&Value>) -> std::io::Result<(String, Value)> {
        let cut = || std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the answer was cut");
        let body = body.map(Value::to_string).unwrap_or_default();
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.port,
            body.len()
        );
        stream.write_all(request.as_bytes())?;
        // Read to the head's end, then Content-Length bytes: ChromeDriver
        // may keep the connection open whatever the request asks.
        let mut reply = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        let (head, body_start, length) = loop {
            let n = stream.read(&mut chunk)?;
            if n == 0 {
                return Err(cut());
            }
            reply.extend_from_slice(&chunk[..n]);
            if let Some(end) = reply.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&reply[..end]).into_owned();
                let length = head
                    .lines()
                    .find_map(|l| {
                        let (name, value) = l.split_once(':')?;
                        name.eq_ignore_ascii_case("content-length")
                            .then(|| value.trim().parse::<usize>().ok())?
                    })
                    .unwrap_or(0);
                break (head, end + 4, length);
            }
        };
        while reply.len() < body_start + length {
            let n = stream.read(&mut chunk)?;
            if n == 0 {
                return Err(cut());
            }
            reply.extend_from_slice(&chunk[..n]);
        }
        let value: Value =
            serde_json::from_slice(&reply[body_start..body_start + length]).unwrap_or(Value::Null);
        Ok((head, value))
    }

    fn session_call(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        self.call(method, &format!("/session/{}{path}", self.session), body)
    }

    /// Opens `url`.
    pub fn goto(&self, url: &str) {
        self.session_call("POST", "/url", Some(&json!({ "url": url })));
    }

    /// The first element `css` selects, waiting up to 20 s for it.
    pub fn find(&self, css: &str) -> String {
        let query = json!({ "using": "css selector", "value": css });
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let found = self.session_call("POST", "/elements", Some(&query));
            if let Some(id) = found.as_array().and_then(|a| a.first()).and_then(|e| e[ELEMENT].as_str()) {
                return id.to_owned();
            }
            assert!(Instant::now() < deadline, "no element {css}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Clicks the element `css` selects.
    pub fn click(&self, css: &str) {
        let id = self.find(css);
        self.session_call("POST", &format!("/element/{id}/click"), Some(&json!({})));
    }

    /// Types `text` into the element `css` selects, as keys.
    pub fn type_text(&self, css: &str, text: &str) {
        let id = self.find(css);
        self.session_call("POST", &format!("/element/{id}/value"), Some(&json!({ "text": text })));
    }

    /// Empties the field `css` selects.
    pub fn clear(&self, css: &str) {
        let id = self.find(css);
        self.session_call("POST", &format!("/element/{id}/clear"), Some(&json!({})));
    }

    /// The visible text of the element `css` selects.
    pub fn text(&self, css: &str) -> String {
        let id = self.find(css);
        self.session_call("GET", &format!("/element/{id}/text"), None).as_str().unwrap_or_default().to_owned()
    }

    /// A property of the element `css` selects (`value`, `disabled`, …).
    pub fn property(&self, css: &str, name: &str) -> Value {
        let id = self.find(css);
        self.session_call("GET", &format!("/element/{id}/property/{name}"), None)
    }

    /// Waits up to `timeout` for the text of `css` to contain `wanted`;
    /// returns the text.
    pub fn wait_text(&self, css: &str, wanted: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let text = self.text(css);
            if text.contains(wanted) {
                return text;
            }
            assert!(Instant::now() < deadline, "{css} never showed {wanted:?}; it shows {text:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs `script` (an async function body: its last argument is the
    /// callback) in the page; what it passes back.
    pub fn run_async(&self, script: &str) -> Value {
        self.session_call("POST", "/execute/async", Some(&json!({ "script": script, "args": [] })))
    }

    /// Presses a key on the focused element (`\u{e004}` is Tab).
    pub fn key(&self, css: &str, key: char) {
        self.type_text(css, &key.to_string());
    }

    /// The id of the element that has the keyboard focus.
    pub fn focused_id(&self) -> String {
        let active = self.session_call("GET", "/element/active", None);
        let id = active[ELEMENT].as_str().unwrap_or_default().to_owned();
        self.session_call("GET", &format!("/element/{id}/attribute/id"), None)
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Types `text` into the page's open prompt and accepts it.
    pub fn answer_prompt(&self, text: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        // The prompt opens after the click's handler runs.
        while self.try_call("GET", &format!("/session/{}/alert/text", self.session)).is_none() {
            assert!(Instant::now() < deadline, "no prompt opened");
            std::thread::sleep(Duration::from_millis(50));
        }
        self.session_call("POST", "/alert/text", Some(&json!({ "text": text })));
        self.session_call("POST", "/alert/accept", Some(&json!({})));
    }

    /// A PNG of the viewport, written to `path`.
    pub fn screenshot(&self, path: &Path) {
        use base64::Engine as _;
        let data = self.session_call("GET", "/screenshot", None);
        let png =
            base64::engine::general_purpose::STANDARD.decode(data.as_str().unwrap_or_default()).unwrap();
        std::fs::write(path, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = self.try_call("DELETE", &format!("/session/{}", self.session));
        }
        if let Some(mut child) = self.driver.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
