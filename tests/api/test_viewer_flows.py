"""The web viewer's flows in headless Chromium against a real sidecar: a token entered after a
401 runs the whole action again, a page opened while the model loads recovers, compare cards
outlive a sidecar that stops answering, Back and Forward and pasted permalinks, one job per
press of Run, the Jobs list's pages, and the charts, legends and titles the page draws.

Faults the sidecar cannot be asked for (no answer, a 503 while loading, an answer lost after
the job was queued) come from a wrapper around the page's ``fetch`` (``FAULTS``); the rest of
every request is the real sidecar's."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from limelight.api.viewer.routes import MAX_LIST
from tests.api import test_viewer
from tests.api.test_viewer import (
    TEXT,
    base,
    call,
    explain_in_page,
    heatmap,
    no_console_errors,
    open_viewer,
    wait_job,
)
from tests.browser import needs_browser, wait
from tests.conftest import RunningSidecar, two_token_sidecar
from tests.tiny_bert import save_tiny_bert

#: The sidecars of tests/api/test_viewer.py, as fixtures of this module too.
viewer_sidecar = test_viewer.viewer_sidecar
multi_label_sidecar = test_viewer.multi_label_sidecar

DULL = "a dull and tedious film"
CHARMING = "an utterly charming story"

#: A wrapper around the page's fetch: every request is logged in ``window.__requests``
#: ({method, path, body}); the first rule of ``window.__faults`` that matches a request (by
#: method and a regular expression on its path under api/) answers it instead of the sidecar:
#: "network" (no answer), "lost" (the sidecar gets it, its answer is lost), "no-class-scores"
#: (the sidecar's answer without class_scores: another class needs a request), "unfinished"
#: (the sidecar's list of jobs with each job still running), or an HTTP status. A rule's
#: ``left`` counts the requests it still answers (-1: all). A rule with ``hold`` keeps its
#: answer (the sidecar's, or with "network" none) until ``release``: an answer that arrives
#: late, after the page has moved on.
FAULTS = """
(() => {
  if (window.__faults) return;
  const real = window.fetch.bind(window);
  window.__faults = [];
  window.__requests = [];
  window.__held = [];
  // The answer is read before it is held, and handed over without a read of its own: the page
  // has it within the task that lets it go (release), so what it does with it is done there.
  const held = async (rule, input, init) => {
    const response = rule.action === "network" ? null : await real(input, init);
    const text = response ? await response.text() : "";
    await new Promise((resolve) => window.__held.push(resolve));
    if (!response) throw new TypeError("Failed to fetch");
    const answer = new Response(text, { status: response.status, headers: response.headers });
    answer.json = async () => JSON.parse(text);
    return answer;
  };
  window.fetch = async (input, init = {}) => {
    const url = new URL(typeof input === "string" ? input : input.url, location.href);
    const method = (init.method || "GET").toUpperCase();
    const path = url.pathname.replace(/^.*\\/viewer\\/api\\//, "") + url.search;
    window.__requests.push({ method, path, body: init.body ? JSON.parse(init.body) : null });
    const rule = window.__faults.find((r) => r.left !== 0 &&
      (!r.method || r.method === method) && new RegExp(r.path).test(path));
    if (!rule) return real(input, init);
    if (rule.left > 0) rule.left -= 1;
    if (rule.hold) return held(rule, input, init);
    if (rule.action === "network") throw new TypeError("Failed to fetch");
    if (rule.action === "lost") {
      await real(input, init);
      throw new TypeError("Failed to fetch");
    }
    const json = { "Content-Type": "application/json" };
    if (rule.action === "no-class-scores") {
      const response = await real(input, init);
      const body = await response.json();
      if (body) body.class_scores = null;
      return new Response(JSON.stringify(body), { status: response.status, headers: json });
    }
    if (rule.action === "unfinished") {
      const response = await real(input, init);
      const body = await response.json();
      for (const job of body.jobs || []) Object.assign(job, { state: "running", terminal: false });
      return new Response(JSON.stringify(body), { status: response.status, headers: json });
    }
    return new Response(JSON.stringify({ error: rule.error || `HTTP ${rule.action}` }),
      { status: rule.action, headers: json });
  };
})();
"""


def js(driver: Any, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


def faults(driver: Any, *rules: dict[str, Any]) -> None:
    """Wrap the page's fetch (once per page) and answer with ``rules`` from now on."""
    js(
        driver,
        FAULTS + "window.__faults.splice(0, window.__faults.length, ...arguments[0]);",
        rules,
    )


def held(driver: Any) -> int:
    """How many answers a ``hold`` rule keeps (a request counts once its answer is there)."""
    return int(js(driver, "return (window.__held || []).length"))


def release(driver: Any) -> None:
    """Hand the held answers over; the page is done with them when this returns."""
    driver.execute_async_script(
        "window.__held.splice(0).forEach((go) => go()); setTimeout(arguments[0], 0);"
    )


def requests(driver: Any, method: str, path: str) -> list[dict[str, Any]]:
    """The requests the page sent (since ``faults`` wrapped its fetch) matching ``path``."""
    logged = js(driver, "return window.__requests || []")
    return [r for r in logged if r["method"] == method and re.search(path, r["path"])]


@contextmanager
def on_every_page(driver: Any, script: str) -> Iterator[None]:
    """Run ``script`` in every page the browser opens, before the page's own scripts."""
    added = driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": script})
    try:
        yield
    finally:
        driver.execute_cdp_cmd(
            "Page.removeScriptToEvaluateOnNewDocument", {"identifier": added["identifier"]}
        )


def shown(driver: Any, element_id: str) -> bool:
    """Whether the page has that element, not hidden (False off the viewer, after a Back that
    left it)."""
    script = "const e = document.getElementById(arguments[0]); return e !== null && !e.hidden"
    return bool(js(driver, script, element_id))


def text_of(driver: Any, element_id: str) -> str:
    script = "const e = document.getElementById(arguments[0]); return e ? e.textContent : ''"
    return str(js(driver, script, element_id))


def explained(driver: Any) -> str:
    """The text of the explanation on show ('' for none)."""
    said = text_of(driver, "compare-text")
    return said[len("Text: “") : -1] if said.startswith("Text: “") else ""


def words(driver: Any) -> list[str]:
    return [t for t, _, _ in heatmap(driver)]


def enter_token(driver: Any, token: str) -> None:
    from selenium.webdriver.common.by import By

    form = wait(driver, lambda d: [f for f in d.find_elements(By.ID, "auth") if f.is_displayed()])
    field = driver.find_element(By.ID, "auth-token")
    field.clear()
    field.send_keys(token)
    form[0].find_element(By.TAG_NAME, "button").click()


def expire_token(driver: Any) -> None:
    """The token in the tab stops working (rotated, revoked): the next request gets a 401."""
    js(driver, "sessionStorage.setItem('limelight.token', 'expired-token')")


def go_to(driver: Any, view: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.CSS_SELECTOR, f"nav a[data-view={view}]").click()
    wait(driver, lambda d: shown(d, f"view-{view}"))


def pick_job_method(driver: Any, name: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, "job-method")).select_by_value(name)


def run_cards(driver: Any) -> list[dict[str, Any]]:
    """The job cards on Compare methods: {id, state, status, legend (ramp shown)}."""
    return list(
        js(
            driver,
            "return [...document.querySelectorAll('#compare-runs .run[data-job-id]')].map(c => ({"
            " id: c.dataset.jobId, state: c.dataset.state,"
            " status: c.querySelector('.meta').textContent,"
            " legend: Boolean(c.querySelector('.legend .ramp'))}))",
        )
    )


def card_status(driver: Any, index: int) -> str:
    """The status line of the ``index``-th job card ('' while there is none)."""
    cards = run_cards(driver)
    return str(cards[index]["status"]) if len(cards) > index else ""


def jobs_of(sidecar: RunningSidecar, token: str | None = None) -> list[dict[str, Any]]:
    status, listing, _ = call(f"{base(sidecar)}/viewer/api/jobs?limit={MAX_LIST}", token=token)
    assert status == 200, listing
    jobs: list[dict[str, Any]] = listing["jobs"]
    return jobs


# --- bearer tokens -----------------------------------------------------------------------------


@pytest.fixture
def two_tokens(
    start_sidecar: Callable[..., RunningSidecar], random_bert_dir: Path, tmp_path: Path
) -> RunningSidecar:
    """A sidecar that takes two bearer tokens (two owners of jobs)."""
    return two_token_sidecar(start_sidecar, tmp_path, model_dir=random_bert_dir)


def sign_in(driver: Any, sidecar: RunningSidecar, token: str = "alice-token") -> None:
    """Open the viewer in a tab without a token and enter ``token`` when asked."""
    driver.get(f"{base(sidecar)}/viewer/")
    enter_token(driver, token)
    wait(driver, lambda d: "random-bert" in text_of(d, "model-badge"))


@needs_browser
def test_a_token_entered_after_a_401_shows_the_explanation_asked_for(
    browser: Any, two_tokens: RunningSidecar
) -> None:
    """The explain runs again, whole: the text asked for is shown, not the one before."""
    from selenium.webdriver.common.by import By

    driver = browser
    sign_in(driver, two_tokens)
    explain_in_page(driver, TEXT)
    expire_token(driver)
    js(driver, "document.getElementById('text').value = arguments[0]", DULL)
    driver.find_element(By.ID, "explain-button").click()
    enter_token(driver, "alice-token")
    wait(driver, lambda d: explained(d) == DULL and heatmap(d))
    assert "tedious" in "".join(words(driver))
    assert not shown(driver, "auth") and not shown(driver, "error")
    js(driver, "sessionStorage.clear()")


@needs_browser
def test_a_token_entered_after_a_401_shows_the_job_run(
    browser: Any, two_tokens: RunningSidecar
) -> None:
    """Run goes on once the token is entered: one job queued, and its card shown (not a job
    the page never shows, and a second one when Run is pressed again)."""
    from selenium.webdriver.common.by import By

    driver = browser
    sign_in(driver, two_tokens)
    explain_in_page(driver, TEXT)
    go_to(driver, "compare")
    pick_job_method(driver, "random")
    expire_token(driver)
    driver.find_element(By.ID, "compare-submit").click()
    enter_token(driver, "alice-token")
    cards = wait(driver, lambda d: [c for c in run_cards(d) if c["state"] == "succeeded"])
    assert len(run_cards(driver)) == 1
    assert [j["id"] for j in jobs_of(two_tokens, "alice-token")] == [cards[0]["id"]]
    js(driver, "sessionStorage.clear()")


@needs_browser
def test_a_token_entered_after_a_401_shows_the_job_and_the_list_asked_for(
    browser: Any, two_tokens: RunningSidecar
) -> None:
    """Open shows the job once the token is entered; Refresh shows the new token's jobs, not
    the list of the token before."""
    from selenium.webdriver.common.by import By

    url = f"{base(two_tokens)}/viewer/api/jobs"
    status, job, _ = call(url, {"method": "random", "text": TEXT}, token="alice-token")
    assert status == 201, job
    assert wait_job(f"{url}/{job['id']}", token="alice-token")["state"] == "succeeded"
    driver = browser
    sign_in(driver, two_tokens)
    go_to(driver, "jobs")
    row = wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#jobs-table tr[data-job-id]"))
    expire_token(driver)
    row[0].find_element(By.XPATH, ".//button[text()='Open']").click()
    enter_token(driver, "alice-token")
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#job-detail .tok"))
    assert job["id"] in text_of(driver, "job-detail")

    expire_token(driver)
    driver.find_element(By.ID, "jobs-refresh").click()
    enter_token(driver, "bob-token")  # who has no jobs
    wait(driver, lambda d: "No jobs yet" in text_of(d, "jobs-table"))
    assert not driver.find_elements(By.CSS_SELECTOR, "#jobs-table tr[data-job-id]")
    js(driver, "sessionStorage.clear()")


@needs_browser
def test_a_deep_link_opened_without_a_token_is_shown_once_it_is_entered(
    browser: Any, start_sidecar: Callable[..., RunningSidecar], random_bert_dir: Path
) -> None:
    from selenium.webdriver.common.by import By

    sidecar = start_sidecar(model_dir=random_bert_dir, auth_token="viewer-secret")
    driver = browser
    link = "#/explain?text=a+dull+and+tedious+film&target=neutral&level=words"
    driver.get(f"{base(sidecar)}/viewer/{link}")
    enter_token(driver, "viewer-secret")
    wait(driver, lambda d: explained(d) == DULL and heatmap(d))
    assert words(driver) == DULL.split()
    assert driver.find_element(By.ID, "target").get_attribute("value") == "1"  # neutral
    assert driver.find_element(By.CSS_SELECTOR, "input[name=level][value=words]").is_selected()
    assert "text=a+dull" in driver.current_url and "viewer-secret" not in driver.current_url
    js(driver, "sessionStorage.clear()")


# --- a sidecar that is loading, restarting or unreachable ----------------------------------------


@needs_browser
def test_a_page_opened_while_the_model_loads_recovers(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """The model route answers 503 (then nothing) while the model loads: the page says so, tries
    again, then shows the model, enables Run and applies its deep link, without a reload."""
    from selenium.webdriver.common.by import By

    loading = [
        {"path": "^model$", "action": "network", "left": 1},
        {"path": "^model$", "action": 503, "error": "the model is still loading", "left": -1},
    ]
    driver = browser
    link = f"{base(viewer_sidecar)}/viewer/#/explain?text=a+dull+and+tedious+film&level=words"
    with on_every_page(driver, FAULTS + f"window.__faults.push(...{json.dumps(loading)});"):
        driver.get(link)
        wait(driver, lambda d: len(requests(d, "GET", "^model$")) >= 3)  # tried again, twice
        assert "retrying" in text_of(driver, "error") and shown(driver, "error")
        assert text_of(driver, "model-badge") == ""
        # Nothing to run yet: Run is off.
        assert js(driver, "return document.getElementById('compare-submit').disabled")
        js(driver, "window.__faults.length = 0")  # loaded
        wait(driver, lambda d: explained(d) == DULL and heatmap(d))
    assert words(driver) == DULL.split()
    assert "random-bert" in text_of(driver, "model-badge") and not shown(driver, "error")
    go_to(driver, "compare")
    assert driver.find_elements(By.CSS_SELECTOR, "#job-method option")
    assert not js(driver, "return document.getElementById('compare-submit').disabled")
    go_to(driver, "model")
    assert driver.find_elements(By.CSS_SELECTOR, "#methods-table tr[data-method=normxlogit]")


def start_run(driver: Any, sidecar: RunningSidecar, *rules: dict[str, Any]) -> None:
    """Explain TEXT, then press Run for the random method with ``rules`` in place."""
    from selenium.webdriver.common.by import By

    open_viewer(driver, sidecar)
    explain_in_page(driver, TEXT)
    go_to(driver, "compare")
    pick_job_method(driver, "random")
    faults(driver, *rules)
    driver.find_element(By.ID, "compare-submit").click()


POLL = "^jobs/[^/?]+$"  # GET jobs/{id}: a card's poll


@needs_browser
def test_compare_cards_outlive_a_sidecar_that_stops_answering(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """A card goes on polling its job through no answer and 5xx answers, saying so, and shows
    the result once the sidecar answers again."""
    driver = browser
    start_run(driver, viewer_sidecar, {"method": "GET", "path": POLL, "action": "network"})
    wait(driver, lambda d: "sidecar unreachable, retrying" in card_status(d, 0))
    assert "Failed to fetch" not in text_of(driver, "error")
    faults(driver, {"method": "GET", "path": POLL, "action": 502})
    wait(driver, lambda d: "(HTTP 502)" in card_status(d, 0))
    faults(driver)  # back
    card = wait(driver, lambda d: [c for c in run_cards(d) if c["state"] == "succeeded"])[0]
    assert "retrying" not in card["status"]


@needs_browser
def test_a_compare_card_stops_when_its_job_is_gone(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    start_run(driver, viewer_sidecar, {"method": "GET", "path": POLL, "action": 404})
    wait(driver, lambda d: "no longer on the sidecar" in card_status(d, 0))
    card = driver.find_element(By.CSS_SELECTOR, "#compare-runs .run[data-job-id]")
    assert not card.find_element(By.XPATH, ".//button[text()='Cancel']").is_displayed()


def job_state(driver: Any, job_id: str) -> str:
    """The state the Jobs table shows for a job ('' while it has no row)."""
    script = (
        "const row = document.querySelector(`#jobs-table tr[data-job-id='${arguments[0]}']`);"
        "return row ? row.cells[2].textContent : ''"
    )
    return str(js(driver, script, job_id))


LIST = r"^jobs\?"  # GET jobs?limit=...: the Jobs table's list


@needs_browser
def test_the_jobs_table_goes_on_refreshing_through_a_sidecar_restart(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """A refresh that gets no answer (or a 5xx) while a job shown is unfinished is tried again
    with backoff, a note saying so instead of the error banner; the table shows the job's end
    once the sidecar answers again, and the note is gone."""
    url = f"{base(viewer_sidecar)}/viewer/api/jobs"
    status, job, _ = call(url, {"method": "random", "text": TEXT})
    assert status == 201, job
    assert wait_job(f"{url}/{job['id']}")["state"] == "succeeded"
    driver = browser
    open_viewer(driver, viewer_sidecar)
    # The job shown as running (it ends while the sidecar is away).
    faults(driver, {"method": "GET", "path": LIST, "action": "unfinished"})
    go_to(driver, "jobs")
    wait(driver, lambda d: job_state(d, job["id"]) == "running")
    faults(driver, {"method": "GET", "path": LIST, "action": "network"})
    wait(driver, lambda d: shown(d, "jobs-note") or shown(d, "error"))
    assert not shown(driver, "error"), text_of(driver, "error")
    assert "unreachable" in text_of(driver, "jobs-note")
    assert "retrying" in text_of(driver, "jobs-note")
    faults(driver, {"method": "GET", "path": LIST, "action": 502})
    wait(driver, lambda d: "HTTP 502" in text_of(d, "jobs-note") or shown(d, "error"))
    assert not shown(driver, "error") and "retrying" in text_of(driver, "jobs-note")
    faults(driver)  # back
    wait(driver, lambda d: job_state(d, job["id"]) == "succeeded")
    assert not shown(driver, "jobs-note") and not shown(driver, "error")


@needs_browser
def test_the_drift_view_goes_on_refreshing_through_a_sidecar_restart(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """Its automatic refresh that gets no answer is tried again with backoff, a note saying so
    instead of the error banner, and shows the report again once the sidecar answers."""
    from selenium.webdriver.common.by import By

    driver = browser
    open_viewer(driver, viewer_sidecar, "#/drift")
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#drift-chart svg"))
    summary = text_of(driver, "drift-summary")
    faults(driver, {"method": "GET", "path": "^drift", "action": "network"})
    wait(driver, lambda d: shown(d, "drift-note") or shown(d, "error"))  # the 10 s refresh
    assert not shown(driver, "error"), text_of(driver, "error")
    assert "retrying" in text_of(driver, "drift-note")
    tried = len(requests(driver, "GET", "^drift"))
    wait(driver, lambda d: len(requests(d, "GET", "^drift")) > tried)  # and again
    # Meanwhile the sidecar explains a text: the report shown next counts it.
    status, _, _ = call(f"{base(viewer_sidecar)}/viewer/api/explain", {"text": TEXT})
    assert status == 200
    faults(driver)  # back
    wait(driver, lambda d: not shown(d, "drift-note"))
    assert not shown(driver, "error")
    wait(driver, lambda d: text_of(d, "drift-summary") != summary)


# --- history and addresses -----------------------------------------------------------------------


@needs_browser
def test_back_and_forward_walk_sections_and_texts(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """Sections and new texts are history entries: Back and Forward walk them in the page."""
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get("about:blank")
    driver.get_log("browser")  # what earlier tests' pages logged is theirs
    open_viewer(driver, viewer_sidecar)
    explain_in_page(driver, TEXT)
    explain_in_page(driver, DULL)
    go_to(driver, "jobs")
    driver.back()
    wait(driver, lambda d: shown(d, "view-explain") and explained(d) == DULL)
    driver.back()
    wait(driver, lambda d: shown(d, "view-explain") and explained(d) == TEXT and heatmap(d))
    assert driver.find_element(By.ID, "text").get_attribute("value") == TEXT
    assert "gorgeous" in "".join(words(driver))
    driver.forward()
    wait(driver, lambda d: explained(d) == DULL and heatmap(d))
    driver.forward()
    wait(driver, lambda d: shown(d, "view-jobs"))
    no_console_errors(driver)


@needs_browser
def test_a_permalink_pasted_into_the_page_is_shown(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """Its text, class and level are shown; Back returns to the explanation before."""
    from selenium.webdriver.common.by import By

    driver = browser
    open_viewer(driver, viewer_sidecar)
    explain_in_page(driver, DULL)
    link = "#/explain?text=an+utterly+charming+story&target=positive&level=words"
    js(driver, "location.hash = arguments[0]", link)
    wait(driver, lambda d: explained(d) == CHARMING and heatmap(d))
    assert words(driver) == CHARMING.split()
    assert driver.find_element(By.ID, "target").get_attribute("value") == "2"  # positive
    assert driver.find_element(By.CSS_SELECTOR, "input[name=level][value=words]").is_selected()
    driver.back()
    wait(driver, lambda d: explained(d) == DULL and heatmap(d))
    assert "text=a+dull" in driver.current_url


@needs_browser
def test_another_class_explains_the_text_shown_not_a_draft(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """A class switch that needs a request (the answer had no scores for the other classes)
    explains the text on show, leaving a draft typed in the box since alone."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = browser
    open_viewer(driver, viewer_sidecar)
    faults(driver, {"method": "POST", "path": "^explain$", "action": "no-class-scores"})
    explain_in_page(driver, TEXT)
    draft = "a draft typed but never explained"
    js(driver, "document.getElementById('text').value = arguments[0]", draft)
    Select(driver.find_element(By.ID, "target")).select_by_value("2")  # positive

    def asked_for_positive(d: Any) -> list[dict[str, Any]]:
        return [r for r in requests(d, "POST", "^explain$") if r["body"].get("target_index") == 2]

    asked = wait(driver, asked_for_positive)
    assert asked[-1]["body"]["text"] == TEXT
    wait(driver, lambda d: "class positive" in heatmap_label(d))
    assert explained(driver) == TEXT
    assert driver.find_element(By.ID, "text").get_attribute("value") == draft


@needs_browser
def test_an_explain_overtaken_by_back_leaves_no_error_when_it_fails_late(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """Back while an explain is on its way shows the text before; the overtaken request's
    failure, arriving after, puts no error over it."""
    from selenium.webdriver.common.by import By

    driver = browser
    open_viewer(driver, viewer_sidecar)
    explain_in_page(driver, TEXT)
    explain_in_page(driver, DULL)
    faults(driver, {"method": "POST", "path": "^explain$", "action": "network", "hold": True})
    js(driver, "document.getElementById('text').value = arguments[0]", CHARMING)
    driver.find_element(By.ID, "explain-button").click()
    wait(driver, lambda d: held(d) == 1)
    faults(driver)  # the explain Back asks for is answered
    driver.back()
    wait(driver, lambda d: explained(d) == TEXT and heatmap(d))
    release(driver)  # the overtaken explain fails now
    assert not shown(driver, "error"), text_of(driver, "error")
    assert explained(driver) == TEXT and "gorgeous" in "".join(words(driver))
    assert not js(driver, "return document.getElementById('explain-button').disabled")


def heatmap_label(driver: Any) -> str:
    return str(js(driver, "return document.getElementById('heatmap').getAttribute('aria-label')"))


@needs_browser
def test_the_compare_permalink_keeps_the_level(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    open_viewer(driver, viewer_sidecar)
    explain_in_page(driver, TEXT)
    driver.find_element(By.CSS_SELECTOR, "input[name=level][value=words]").click()
    go_to(driver, "compare")
    link = driver.current_url
    assert "#/compare?" in link and "level=words" in link
    driver.get("about:blank")
    driver.get(link)
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".inline-run .heatmap .tok"))
    assert driver.find_element(By.CSS_SELECTOR, "input[name=level][value=words]").is_selected()
    shown_words = [t for t, _, _ in heatmap(driver, ".inline-run .heatmap")]
    assert shown_words == ["a", "gorgeous", ",", "witty", ",", "seductive", "movie"]


# --- Run ---------------------------------------------------------------------------------------


@needs_browser
def test_a_double_press_of_run_queues_one_job(browser: Any, viewer_sidecar: RunningSidecar) -> None:
    """Run is off while its job is being queued, and the press sends an idempotency key."""
    driver = browser
    open_viewer(driver, viewer_sidecar)
    explain_in_page(driver, TEXT)
    go_to(driver, "compare")
    pick_job_method(driver, "random")
    faults(driver)
    js(driver, "const b = document.getElementById('compare-submit'); b.click(); b.click();")
    wait(driver, lambda d: [c for c in run_cards(d) if c["state"] == "succeeded"])
    assert len(jobs_of(viewer_sidecar)) == 1 and len(run_cards(driver)) == 1
    posts = requests(driver, "POST", "^jobs$")
    assert len(posts) == 1 and posts[0]["body"]["idempotency_key"]
    assert not js(driver, "return document.getElementById('compare-submit').disabled")


@needs_browser
def test_a_lost_answer_to_run_is_asked_for_again_without_a_second_job(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """The sidecar queues the job but its answer is lost: the page sends the submission again
    with the same idempotency key, gets the same job, and shows it once."""
    from selenium.webdriver.common.by import By

    driver = browser
    start_run(
        driver, viewer_sidecar, {"method": "POST", "path": "^jobs$", "action": "lost", "left": 1}
    )
    wait(driver, lambda d: [c for c in run_cards(d) if c["state"] == "succeeded"])
    assert len(jobs_of(viewer_sidecar)) == 1 and len(run_cards(driver)) == 1
    assert not shown(driver, "error")
    # A new press is a new key, and a new job.
    driver.find_element(By.ID, "compare-submit").click()
    wait(driver, lambda d: len([c for c in run_cards(d) if c["state"] == "succeeded"]) == 2)
    assert len(jobs_of(viewer_sidecar)) == 2
    keys = [p["body"]["idempotency_key"] for p in requests(driver, "POST", "^jobs$")]
    assert len(keys) == 3 and keys[0] == keys[1] != keys[2]


# --- Jobs ----------------------------------------------------------------------------------------


@needs_browser
def test_the_jobs_list_has_more_pages(browser: Any, viewer_sidecar: RunningSidecar) -> None:
    from selenium.webdriver.common.by import By

    url = base(viewer_sidecar)
    ids = []
    for i in range(51):  # one more than a page
        status, job, _ = call(f"{url}/viewer/api/jobs", {"method": "random", "text": f"{TEXT} {i}"})
        assert status == 201, job
        ids.append(job["id"])
    for job_id in ids:
        assert wait_job(f"{url}/viewer/api/jobs/{job_id}")["state"] == "succeeded"

    driver = browser
    driver.get_log("browser")  # what earlier tests' pages logged is theirs
    open_viewer(driver, viewer_sidecar, "#/jobs")

    def rows(d: Any) -> list[str]:
        script = "return [...document.querySelectorAll('#jobs-table tr[data-job-id]')]"
        return list(js(d, script + ".map(r => r.dataset.jobId)"))

    wait(driver, lambda d: len(rows(d)) == 50)
    more = driver.find_element(By.ID, "jobs-more")
    assert more.is_displayed()
    more.click()
    wait(driver, lambda d: len(rows(d)) == 51)
    assert rows(driver) == ids[::-1]  # newest first, none twice
    assert not more.is_displayed()
    no_console_errors(driver)


def open_button(driver: Any, job_id: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f"button[aria-label='Open job {job_id}']")


def detail_of(driver: Any) -> str:
    """The id of the job the detail panel shows ('' for none)."""
    script = (
        "const d = document.getElementById('job-detail'); return d.hidden ? '' : d.dataset.jobId"
    )
    return str(js(driver, script) or "")


def two_jobs(driver: Any, sidecar: RunningSidecar) -> tuple[str, str]:
    """Two finished jobs, listed on the Jobs page."""
    url = f"{base(sidecar)}/viewer/api/jobs"
    ids = []
    for text in (DULL, CHARMING):
        status, job, _ = call(url, {"method": "random", "text": text})
        assert status == 201, job
        ids.append(job["id"])
    for job_id in ids:
        assert wait_job(f"{url}/{job_id}")["state"] == "succeeded"
    open_viewer(driver, sidecar, "#/jobs")
    wait(driver, lambda d: all(job_state(d, job_id) for job_id in ids))
    return ids[0], ids[1]


def hold_job(driver: Any, job_id: str) -> None:
    """Open the job, its answer held (see ``release``)."""
    faults(driver, {"method": "GET", "path": f"^jobs/{job_id}$", "hold": True, "left": 1})
    open_button(driver, job_id).click()
    wait(driver, lambda d: held(d) == 1)


@needs_browser
def test_the_job_opened_last_is_the_one_shown(browser: Any, viewer_sidecar: RunningSidecar) -> None:
    """A job whose answer arrives after another job was opened is not shown, and writes no
    history entry: Back from the job opened last closes it."""
    driver = browser
    first, second = two_jobs(driver, viewer_sidecar)
    hold_job(driver, first)
    open_button(driver, second).click()
    wait(driver, lambda d: detail_of(d) == second)
    release(driver)  # the first job's answer, late
    assert detail_of(driver) == second and f"job={second}" in driver.current_url
    driver.back()
    wait(driver, lambda d: not shown(d, "job-detail"))
    assert "job=" not in driver.current_url and shown(driver, "view-jobs")
    assert not shown(driver, "error")


@needs_browser
def test_a_job_closed_while_it_opens_stays_closed(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """Back while a job opened is on its way closes it: its answer, arriving after, is not
    shown and writes no history entry."""
    driver = browser
    first, second = two_jobs(driver, viewer_sidecar)
    open_button(driver, second).click()
    wait(driver, lambda d: detail_of(d) == second)
    hold_job(driver, first)
    driver.back()
    wait(driver, lambda d: not shown(d, "job-detail"))
    release(driver)  # the first job's answer, late
    assert not shown(driver, "job-detail") and "job=" not in driver.current_url
    assert not shown(driver, "error")


# --- what the page draws ------------------------------------------------------------------------


@needs_browser
def test_every_heatmap_of_a_job_has_its_legend(
    browser: Any, viewer_sidecar: RunningSidecar, tmp_path: Path
) -> None:
    """The cards of Compare methods (the inline one too) and an opened job."""
    from selenium.webdriver.common.by import By

    driver = browser
    start_run(driver, viewer_sidecar)
    card = wait(driver, lambda d: [c for c in run_cards(d) if c["state"] == "succeeded"])[0]
    assert card["legend"]
    assert driver.find_elements(By.CSS_SELECTOR, "#compare-runs .inline-run .legend .ramp")
    driver.save_screenshot(str(tmp_path / "viewer_compare_legends.png"))
    go_to(driver, "jobs")
    row = wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#jobs-table tr[data-job-id]"))
    row[0].find_element(By.XPATH, ".//button[text()='Open']").click()
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#job-detail .tok"))
    assert driver.find_elements(By.CSS_SELECTOR, "#job-detail .legend .ramp")
    driver.save_screenshot(str(tmp_path / "viewer_job_legend.png"))
    assert f"job={card['id']}" in driver.current_url


LONG_LABEL = "an extraordinarily long label name that nobody ever thought of abbreviating"


@needs_browser
def test_drift_charts_fit_long_labels(
    browser: Any,
    start_sidecar: Callable[..., RunningSidecar],
    tmp_path: Path,
    tokenizer_dir: Path,
) -> None:
    """The drift chart's legend and the label-mix chart's labels stay inside the chart and off
    the bars; a label too long is cut, whole in its tooltip."""
    from selenium.webdriver.common.by import By

    model = save_tiny_bert(tmp_path / "long", tokenizer_dir, ["ok", LONG_LABEL, "bad"], seed=5)
    sidecar = start_sidecar(model_dir=model, viewer_drift_sample_s=0)
    driver = browser
    driver.get_log("browser")  # what earlier tests' pages logged is theirs
    open_viewer(driver, sidecar, "#/drift")
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#drift-chart svg, #drift-mix svg"))
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#drift-mix svg rect"))
    # Every text of the drift chart ends inside its drawing.
    overflow = js(
        driver,
        "const s = document.querySelector('#drift-chart svg');"
        "const width = s.viewBox.baseVal.width;"
        "return [...s.querySelectorAll('text')].map(t => { const b = t.getBBox();"
        " return [t.textContent, b.x + b.width - width]; }).filter(([, o]) => o > 0.5)",
    )
    assert not overflow, overflow
    # Each label of the mix chart ends before its bar begins.
    overlaps = js(
        driver,
        "const s = document.querySelector('#drift-mix svg');"
        "const texts = [...s.querySelectorAll('text')];"
        "return [...s.querySelectorAll('rect')].flatMap(r => { const y = r.y.baseVal.value;"
        " const h = r.height.baseVal.value; const x = r.x.baseVal.value;"
        " return texts.filter(t => { const b = t.getBBox();"
        "  return b.y + b.height / 2 > y && b.y + b.height / 2 < y + h && b.x < x; })"
        "  .map(t => [t.textContent, t.getBBox().x + t.getBBox().width - x]); })"
        " .filter(([, o]) => o > 0.5)",
    )
    assert not overlaps, overlaps
    driver.save_screenshot(str(tmp_path / "viewer_drift_long_labels.png"))
    for chart in ("#drift-chart", "#drift-mix"):
        tips = js(
            driver,
            "return [...document.querySelectorAll(arguments[0] + ' svg title')]"
            ".map(t => t.textContent)",
            chart,
        )
        assert LONG_LABEL in tips, (chart, tips)
        cut = js(
            driver,
            "return [...document.querySelectorAll(arguments[0] + ' svg text')]"
            ".map(t => t.textContent).filter(t => t.endsWith('…'))",
            chart,
        )
        assert len(cut) == 1 and LONG_LABEL.startswith(cut[0][:-1]), (chart, cut)
    no_console_errors(driver)


@needs_browser
def test_multi_label_export_titles_name_every_predicted_label(
    browser: Any, multi_label_sidecar: RunningSidecar
) -> None:
    driver = browser
    open_viewer(driver, multi_label_sidecar)
    explain_in_page(driver, TEXT)
    exported = js(driver, "return window.limelightViewer.heatmapSvg()")
    title = re.search(r"<text[^>]*>([^<]*)</text>", exported)
    assert title is not None
    assert re.search(r"\(predicted toxic [\d.]+ %, insult [\d.]+ %\)", title.group(1)), title
    page = js(driver, "return window.limelightViewer.heatmapHtml()")
    assert re.search(r"<h1>[^<]*predicted toxic [\d.]+ %, insult [\d.]+ %", page), page[:400]


@needs_browser
def test_a_rejected_explain_clears_the_heatmap(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """A text the sidecar refuses (over the character limit) leaves no heat-map of the text
    before under it."""
    from selenium.webdriver.common.by import By

    driver = browser
    open_viewer(driver, viewer_sidecar)
    explain_in_page(driver, TEXT)
    _, model, _ = call(f"{base(viewer_sidecar)}/viewer/api/model")
    limit = model["max_text_chars"]
    js(driver, "document.getElementById('text').value = arguments[0]", "word " * (limit // 5 + 1))
    driver.find_element(By.ID, "explain-button").click()
    wait(driver, lambda d: "limit" in text_of(d, "error"))
    assert not driver.find_elements(By.CSS_SELECTOR, "#heatmap .tok")
    assert not shown(driver, "explain-result")
    assert explained(driver) == ""


BIDI = "a\u202egood film is bad"
CONTROLS = re.compile("[\u202a-\u202e\u2066-\u2069]")


@needs_browser
def test_a_bidirectional_override_leaves_the_heatmap_in_the_texts_order(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """U+202E (right-to-left override) would draw every token after it backwards: the map
    shows it as U+FFFD (as the CLI and the SDK do), and its tokens left to right; so do the
    exports."""
    from selenium.webdriver.common.by import By

    driver = browser
    open_viewer(driver, viewer_sidecar)
    js(driver, "document.getElementById('text').value = arguments[0]", BIDI)
    driver.find_element(By.ID, "explain-button").click()
    wait(driver, lambda d: explained(d) == BIDI and heatmap(d))
    for level in ("tokens", "words"):
        driver.find_element(By.CSS_SELECTOR, f"input[name=level][value={level}]").click()
        assert ("words" in heatmap_label(driver)) == (level == "words")
        lefts = js(
            driver,
            "return [...document.querySelectorAll('#heatmap .tok')]"
            ".map(s => s.getBoundingClientRect().left)",
        )
        assert lefts == sorted(lefts) and len(set(lefts)) == len(lefts), (level, lefts)
        assert not CONTROLS.search(text_of(driver, "heatmap")), level
        assert "\ufffd" in text_of(driver, "heatmap") + "".join(words(driver))
        for export in ("heatmapHtml", "heatmapSvg"):
            page = js(driver, f"return window.limelightViewer.{export}()")
            assert not CONTROLS.search(page), (level, export)
