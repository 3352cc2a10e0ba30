"""The admin, and the static files under DEBUG so the check can fetch the wheel's CSS."""

from django.contrib import admin
from django.contrib.staticfiles.urls import staticfiles_urlpatterns
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls), *staticfiles_urlpatterns()]
