from django.apps import AppConfig


class DemoConfig(AppConfig):
    name = "testproject.demo"
    label = "demo"
