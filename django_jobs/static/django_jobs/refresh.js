/* django-jobs admin: a page that refreshes itself while nobody is using it.
 *
 * A page that may refresh has, in its status line (templates/admin/django_jobs/status.html),
 *   <span id="jobs-refresh" data-seconds="10" data-mode="swap" hidden>
 *     <input type="checkbox" id="jobs-refresh-toggle"> … <span id="jobs-refresh-status"></span>
 *   </span>
 * Without this script it stays hidden and the page never refreshes. With it, every
 * data-seconds, while the toggle is on, the tab is visible and nothing is under way on the
 * page (a focused field, a field or checkbox changed, selected text), the page is fetched
 * again and then:
 *   - "swap": its #content replaces this one (the messages above it stay);
 *   - "reload": the page is reloaded, once the fetch showed it answers (the job list, whose
 *     checkboxes Django's own script binds once, when the page loads).
 * A failed fetch changes nothing; the next tick tries again. The toggle is remembered in
 * localStorage. A static file, loaded with the page's CSP nonce: no inline script.
 */
"use strict";
{
    const STORAGE_KEY = "django_jobs.autoRefresh";
    const TYPED = "textarea, select, input:not([type=checkbox]):not([type=radio])"
        + ":not([type=submit]):not([type=button]):not([type=reset]):not([type=hidden])";
    const root = document.documentElement;
    let fetching = false;
    let lastRefresh = Date.now();

    function remembered() {
        try {
            return localStorage.getItem(STORAGE_KEY) !== "off";
        } catch (error) {
            return true;
        }
    }

    function remember(on) {
        try {
            localStorage.setItem(STORAGE_KEY, on ? "on" : "off");
        } catch (error) {
            // Storage refused (private mode): the toggle still works for this page.
        }
    }

    function toggle() {
        return document.getElementById("jobs-refresh-toggle");
    }

    function say(text) {
        const status = document.getElementById("jobs-refresh-status");
        if (status) {
            status.textContent = text;
        }
    }

    function showControl() {
        const control = document.getElementById("jobs-refresh");
        if (control) {
            control.hidden = false;
            toggle().checked = remembered();
        }
    }

    function changed(field) {
        if (field.id === "jobs-refresh-toggle") {
            return false;
        }
        if (field.type === "checkbox" || field.type === "radio") {
            return field.checked !== field.defaultChecked;
        }
        if (field.tagName === "SELECT") {
            const options = Array.from(field.options);
            if (field.multiple) {
                return options.some((option) => option.selected !== option.defaultSelected);
            }
            const initial = Math.max(0, options.findIndex((option) => option.defaultSelected));
            return options.length > 0 && field.selectedIndex !== initial;
        }
        if (["hidden", "submit", "button", "reset"].includes(field.type)) {
            return false;
        }
        return field.value !== field.defaultValue;
    }

    // Why the page must not change under its user now; "" when it may.
    function inUse() {
        if (document.visibilityState !== "visible") {
            return "the tab is hidden";
        }
        // A field one types in or picks from; a checkbox or a button keeps the focus after
        // a click, which says nothing of what is under way (a ticked box does, below).
        const active = document.activeElement;
        if (active && active.matches(TYPED)) {
            return "a field has the focus";
        }
        const content = document.getElementById("content");
        const fields = content ? content.querySelectorAll("input, select, textarea") : [];
        if (Array.from(fields).some(changed)) {
            return "a form is being filled in";
        }
        const selection = window.getSelection();
        if (selection && selection.toString().trim()) {
            return "text is selected";
        }
        return "";
    }

    function count(name) {
        root.dataset[name] = String(Number(root.dataset[name] || 0) + 1);
    }

    async function tick() {
        count("jobsRefreshTicks");
        const control = document.getElementById("jobs-refresh");
        if (!control || fetching || !toggle().checked) {
            return;
        }
        const busy = inUse();
        if (busy) {
            say(`Paused: ${busy}.`);
            return;
        }
        const reload = control.dataset.mode === "reload";
        fetching = true;
        try {
            const response = await fetch(window.location.href, {
                method: reload ? "HEAD" : "GET",
                credentials: "same-origin",
                cache: "no-store",
                headers: {Accept: "text/html"},
            });
            if (response.redirected) {
                say("Not refreshed: log in again.");
                return;
            }
            if (!response.ok) {
                say(`Not refreshed: the server answered ${response.status}; trying again.`);
                return;
            }
            const html = reload ? "" : await response.text();
            // The user may have started something while the page was fetched.
            const nowBusy = inUse();
            if (nowBusy || !toggle().checked) {
                say(nowBusy ? `Paused: ${nowBusy}.` : "");
                return;
            }
            lastRefresh = Date.now();
            if (reload) {
                window.location.reload();
                return;
            }
            const fresh = new DOMParser().parseFromString(html, "text/html").getElementById("content");
            const current = document.getElementById("content");
            if (!fresh || !current) {
                say("Not refreshed: the page came back without its content.");
                return;
            }
            current.replaceWith(document.importNode(fresh, true));
            showControl();
            count("jobsRefreshes");
        } catch (error) {
            say("Not refreshed: the server did not answer; trying again.");
        } finally {
            fetching = false;
        }
    }

    function start() {
        const control = document.getElementById("jobs-refresh");
        const seconds = control ? Number(control.dataset.seconds) : 0;
        if (!(seconds > 0)) {
            return;
        }
        showControl();
        document.addEventListener("change", (event) => {
            if (event.target.id === "jobs-refresh-toggle") {
                remember(event.target.checked);
                say(event.target.checked ? "" : "Off.");
            }
        });
        // Back in a tab left long enough: refresh at once rather than at the next tick.
        document.addEventListener("visibilitychange", () => {
            if (document.visibilityState === "visible" && Date.now() - lastRefresh >= seconds * 1000) {
                tick();
            }
        });
        window.setInterval(tick, seconds * 1000);
        root.dataset.jobsRefreshReady = "true";
    }

    if (document.readyState === "loading") {
        document.addEventListener("DOMContentLoaded", start);
    } else {
        start();
    }
}
