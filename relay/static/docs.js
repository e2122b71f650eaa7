// The API browser of /docs: Swagger UI (vendored in static/swagger/), reading Relay's own
// openapi.json. Everything comes from Relay: no validator badge (it would load an image from
// validator.swagger.io), and the key typed in under "Authorize" is kept only by the page.
// Paths are relative to the page, so that Relay may be served below a path prefix by a reverse
// proxy; the document names no server, so "Try it out" is pointed at that prefix.
"use strict";

window.addEventListener("DOMContentLoaded", () => {
  const prefix = new URL(".", location.href).pathname.replace(/\/$/, "");
  window.ui = SwaggerUIBundle({
    url: "openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    validatorUrl: null,
    persistAuthorization: false,
    requestInterceptor: (req) => {
      // Calls of "Try it out" are made to the page's origin at the API's paths: put the prefix in
      // front of each, even one the API's paths also start with (Relay served at /v2/). The
      // fetch of the document itself (loadSpec) is relative to the page already.
      const url = new URL(req.url, location.href);
      if (prefix && !req.loadSpec && url.origin === location.origin) {
        url.pathname = prefix + url.pathname;
        req.url = url.toString();
      }
      return req;
    },
  });
});
