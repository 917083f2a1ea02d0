"""The playground page in a real headless browser (Debian's chromium and chromedriver through
selenium) against a live server: it reads the model card, streams a completion that equals
tinyloop's own text at the chosen loops, shows loops used, tokens/s and the stop reason, reports a
refused request, and its Stop button ends a stream early."""

from __future__ import annotations

import shutil
import time

import pytest

pytest.importorskip("fastapi")
webdriver = pytest.importorskip("selenium.webdriver")

from test_serve import Live, expected  # noqa: E402

from tinyloop.serve import ServeConfig  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    pytest.skip("needs chromium and chromedriver (Debian: apt-get install chromium chromium-driver)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def page():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    live = Live(ServeConfig(backend="cpu", max_seq_len=320, queue_size=4))
    opts = Options()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_page_load_timeout(60)
    try:
        driver.get(live.url + "/")
        wait(lambda: driver.find_element("id", "model").text == "demo")
        yield live, driver
    finally:
        driver.quit()
        live.close()


def wait(cond, timeout=60.0):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, "timed out waiting for the page"
        time.sleep(0.05)


def fill(driver, **values):
    for key, v in values.items():
        driver.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                              "e.dispatchEvent(new Event('input'));", key, str(v))


def text(driver, id_):
    return driver.find_element("id", id_).text


def test_streams_a_completion_equal_to_tinyloop(page):
    live, driver = page
    assert text(driver, "maxloops") == str(live.model.cfg.max_loops)
    fill(driver, prompt="def ", loops=3, decoder="greedy", temperature=0, max_tokens=24)
    assert text(driver, "loopsval") == "3"
    driver.find_element("id", "go").click()
    wait(lambda: text(driver, "reason") not in ("", "–"))
    want = expected(live.model, "def ", 24, loops=3)
    got = driver.execute_script("return document.getElementById('output').textContent")
    assert got == want
    assert text(driver, "reason") == "MAX_TOKENS" and text(driver, "loopsused") == "3"
    assert text(driver, "ntok") == "24" and float(text(driver, "tps")) > 0
    assert text(driver, "error") == ""


def test_a_refused_request_is_shown(page):
    live, driver = page
    fill(driver, prompt="x", loops=3, decoder="greedy", temperature=0, max_tokens=100000)
    driver.find_element("id", "go").click()
    wait(lambda: text(driver, "error") != "")
    assert text(driver, "error").startswith("400") and "max_seq_len" in text(driver, "error")


def test_stop_ends_the_stream(page):
    live, driver = page
    fill(driver, prompt="x", loops=3, decoder="greedy", temperature=0, max_tokens=280)
    driver.find_element("id", "go").click()
    wait(lambda: int(text(driver, "ntok") or 0) >= 3)
    driver.find_element("id", "stop").click()
    wait(lambda: driver.find_element("id", "go").is_enabled())
    assert int(text(driver, "ntok")) < 280 and text(driver, "error") == ""
